"""The command line: one function per subcommand, each a thin call into the library (``plan``
and ``advise`` live in ``cli_plan.py``).

A ``UserError`` (bad flag, file, rule, mesh, model or data) prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import math
import sys

from shardzoo.cli_plan import add_advise_args, add_plan_args, cmd_advise, cmd_plan
from shardzoo.errors import EnvironmentFault, UserError
from shardzoo.values import seed_arg


# --------------------------------------------------------------------------- train
def add_train_args(p: argparse.ArgumentParser) -> None:
    from shardzoo.train.flags import add_arguments

    add_arguments(p)


def report_train(result) -> int:
    """Print how a run ended (``launch.RunResult``) and return its exit status: 0 when done,
    preempted (SIGTERM) or with nothing to do, 130 on Ctrl-C, 3 on a NaN/Inf step."""
    from shardzoo.train import launch
    from shardzoo.train.config import NONFINITE_EXIT

    if result.main_process:
        if result.status == launch.INTERRUPTED:
            print(f"shardzoo train: interrupted: {result.message}", file=sys.stderr, flush=True)
        elif result.status == launch.NONFINITE:
            print(f"shardzoo train: error: {result.message}", file=sys.stderr, flush=True)
        else:
            print(result.message, flush=True)
    return {launch.INTERRUPTED: 130, launch.NONFINITE: NONFINITE_EXIT}.get(result.status, 0)


def cmd_train(args) -> int:
    """Train (or resume) a run in --out; the exit status says how it ended (``report_train``)."""
    from shardzoo.train.flags import config_from_args
    from shardzoo.train.launch import run

    return report_train(run(config_from_args(args), log=_print))


def _print(line: str) -> None:
    print(line, flush=True)


# --------------------------------------------------------------------------- data
PREVIEW_FLAGS = ("rows", "split", "json")


def add_data_args(p: argparse.ArgumentParser) -> None:
    from shardzoo.train.config import SECTIONS
    from shardzoo.train.flags import add_arguments

    add_arguments(p, only=SECTIONS["data"] + ("seed",))
    p.add_argument("--rows", type=int, default=2, metavar="N", help="rows (or examples) to show (default: 2)")
    p.add_argument("--split", default="train", choices=("train", "eval"), help="the split to show (default: train)")
    p.add_argument("--json", action="store_true", help="print the counts and rows as JSON")


def cmd_data(args) -> int:
    """Show how the data flags (train's) tokenize, pack and mask: counts and the first rows."""
    import json

    from shardzoo.data.preview import format_preview, preview_labelled, preview_lm
    from shardzoo.train.flags import config_from_args
    from shardzoo.train.launch import data_config_of

    if args.rows < 0:
        raise UserError(f"--rows must be 0 or more, got {args.rows}")
    if not sys.stderr.isatty():  # keep a user error one line on a log
        import datasets

        datasets.disable_progress_bars()
    given = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in PREVIEW_FLAGS})
    cfg = config_from_args(given)
    config = data_config_of(cfg)
    if args.split == "eval" and not (config.eval_data or config.eval_fraction):
        raise UserError("--split eval: this data spec holds out no eval split (give --eval-data or --eval-fraction)")
    if config.labelled:
        preview = preview_labelled(config, cfg.batch_size, cfg.seed, args.rows, args.split)
    else:
        preview = preview_lm(config, cfg.seq_len, cfg.seed, args.rows, args.split)
    print(json.dumps({"data": cfg.data, **preview}, indent=1) if args.json else format_preview(preview, cfg.data))
    return 0


# --------------------------------------------------------------------------- plot
def add_plot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", metavar="OUT", help="a run directory holding metrics.jsonl")
    p.add_argument("--output", metavar="PNG", help="where to write the plot (default: OUT/loss.png)")


def cmd_plot(args) -> int:
    """Draw the run's train and eval loss curves, and its task's learning signals, to a PNG."""
    from shardzoo.train.io.rundir import read_run_json
    from shardzoo.train.metrics import plot_losses
    from shardzoo.train.tasks.registry import run_signals

    print(plot_losses(args.out, args.output, run_signals(read_run_json(args.out))))
    return 0


# --------------------------------------------------------------------------- generate
def _add_sharding_args(p: argparse.ArgumentParser, dtype_default: str) -> None:
    p.add_argument("--rules", default=None, metavar="NAME|FILE",
                   help="rule table (default: fsdp on more than one device, dp on one)")
    p.add_argument("--mesh", default=None, metavar="SPEC",
                   help="mesh spec (default: every device on the first of fsdp, tensor that the "
                        "rules use, else on data)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help=f"parameter and compute dtype (default: {dtype_default})")


def add_generate_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="a shardzoo run or checkpoint dir")
    src.add_argument("--hf", metavar="HF_DIR",
                     help="a Hugging Face model dir (config.json, safetensors, tokenizer.json) or Hub "
                          "model id ORG/NAME[@REVISION] (from the cache; HF_HUB_OFFLINE, HF_TOKEN)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", metavar="TEXT", help="the text to continue")
    what.add_argument("--prompt-file", metavar="FILE",
                      help="continue the exact text of FILE (UTF-8; a trailing newline is kept)")
    what.add_argument("--messages", metavar="FILE",
                      help="a JSON list of {\"role\", \"content\"} messages, rendered with the model's chat "
                           "template (as chat fine-tuning renders them) and its generation prompt")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to add (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--seed", type=seed_arg, default=0, help="sampling seed, 0 to 2**32-1 (default: 0)")
    _add_step_arg(p)
    _add_sharding_args(p, "float32 for --hf, the checkpoint's for --checkpoint")


def _add_step_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="the checkpoint of step N (default: the newest one that can be restored)")


def cmd_generate(args) -> int:
    """Print the prompt (a rendered --messages conversation) and its continuation."""
    from shardzoo.train import prompts
    from shardzoo.train.defaults import mesh_and_rules
    from shardzoo.train.io import hf_io

    for bad, flag, want in ((args.max_new_tokens < 1, "--max-new-tokens", "must be 1 or more"),
                            (not (math.isfinite(args.temperature) and args.temperature >= 0), "--temperature",
                             "must be a finite number >= 0 (0 is greedy)"),
                            (args.top_k < 0, "--top-k", "must be 0 (off) or more"),
                            (not 0 < args.top_p <= 1, "--top-p", "must be in (0, 1] (1 is off)")):
        if bad:
            raise UserError(f"{flag} {getattr(args, flag[2:].replace('-', '_')):g} {want}")
    if args.step is not None and args.checkpoint is None:
        raise UserError("--step picks a checkpoint of a run: it goes with --checkpoint, not --hf")
    prompt = (prompts.read_prompt_file(args.prompt_file) if args.prompt_file is not None
              else prompts.read_messages(args.messages) if args.messages is not None
              else prompts.Prompt(args.prompt))  # files are checked before the model loads
    mesh, rules = mesh_and_rules(args.mesh, args.rules)
    _, config, params, tokenizer = hf_io.load_for_generate(args.checkpoint, args.hf, mesh, rules, args.dtype,
                                                           step=args.step)
    prompt = prompts.render(prompt, tokenizer)
    # a conversation starts as chat fine-tuning started it: with bos when the run added it
    add_bos = prompt.messages is not None and args.checkpoint is not None and \
        bool(prompts.run_adds_bos(args.checkpoint, args.step))
    print(hf_io.generate_text(config, params, tokenizer, prompt.text, mesh, rules, args.max_new_tokens,
                              args.temperature, args.top_k, args.top_p, args.seed,
                              special_tokens=prompt.special_tokens, what=prompt.source, add_bos=add_bos))
    return 0


# --------------------------------------------------------------------------- import-hf / export-hf
def add_import_hf_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("hf_dir", metavar="HF_DIR",
                   help="config.json + model.safetensors (or an index of shards), or a Hub model id "
                        "ORG/NAME[@REVISION]")
    p.add_argument("out", metavar="OUT_DIR",
                   help="the shardzoo run dir to write (checkpoints/0, tokenizer/)")
    p.add_argument("--no-scan-layers", dest="scan_layers", action="store_false",
                   help="unrolled layers_0, layers_1, ... instead of one scanned stack")
    _add_sharding_args(p, "float32")


def cmd_import_hf(args) -> int:
    """Convert a Hugging Face model dir into a shardzoo run dir."""
    from shardzoo.train.defaults import mesh_and_rules
    from shardzoo.train.io import hf_io

    mesh, rules = mesh_and_rules(args.mesh, args.rules)
    meta = hf_io.import_hf(args.hf_dir, args.out, mesh, rules, args.dtype, args.scan_layers)
    print(f"imported {meta['hf_model_type']} from {args.hf_dir} into {args.out}/checkpoints/0"
          f"{' with its tokenizer' if meta['tokenizer_saved'] else ' (no tokenizer.json)'}")
    return 0


def add_export_hf_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a shardzoo run or checkpoint dir")
    p.add_argument("out", metavar="OUT_DIR", help="the Hugging Face model dir to write")
    p.add_argument("--max-shard-size", type=float, default=5.0, metavar="GIB",
                   help="safetensors shard size in GiB (default: 5)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into OUT_DIR even when it is not empty (its files of the same name are replaced)")
    p.add_argument("--merge-lora", action="store_true",
                   help="a LoRA run: fold the adapters into the base weights (alpha/r A B added)")
    p.add_argument("--into", metavar="HF_DIR",
                   help="the multimodal checkpoint (gemma3, mistral3, ...) the model's text was imported from: "
                        "write it whole, the trained language model in place of its own")
    _add_step_arg(p)
    _add_sharding_args(p, "the checkpoint's param_dtype")


def cmd_export_hf(args) -> int:
    """Write a shardzoo checkpoint as an HF model dir (config.json, safetensors, tokenizer)."""
    from shardzoo.train.defaults import mesh_and_rules
    from shardzoo.train.io import hf_io

    mesh, rules = mesh_and_rules(args.mesh, args.rules)
    if not (math.isfinite(args.max_shard_size) and args.max_shard_size > 0):
        raise UserError(f"--max-shard-size must be a positive number of GiB, got {args.max_shard_size}")
    hf_config = hf_io.export_hf(args.checkpoint, args.out, mesh, rules, args.dtype,
                                int(args.max_shard_size * 2**30), overwrite=args.overwrite, step=args.step,
                                merge_lora=args.merge_lora, into=args.into)
    print(f"exported {hf_config['architectures'][0]} to {args.out}")
    return 0


# --------------------------------------------------------------------------- eval
def add_eval_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="a shardzoo run or checkpoint dir")
    src.add_argument("--hf", metavar="HF_DIR", help="a Hugging Face model dir (with tokenizer.json) or "
                     "Hub model id ORG/NAME[@REVISION]")
    p.add_argument("--data", default=None, metavar="SPEC",
                   help="a file, glob, directory, 'stdlib' or hub:NAME[:CONFIG][@SPLIT] (default: the "
                        "data of the --checkpoint run); --task multiple-choice: rows {context, "
                        "choices, label} (e.g. JSONL)")
    p.add_argument("--task", default=None, choices=("lm", "multiple-choice", "dpo", "kto", "rewards", "reward"),
                   help="lm: loss, perplexity and token accuracy over every row; multiple-choice: "
                        "accuracy by each choice's log-likelihood; dpo: the preference loss and TRL's "
                        "rewards/* and logps/* over prompt/chosen/rejected pairs, against the reference; kto: "
                        "the KTO loss, kl, rewards/* and logps/* over prompt/completion/label rows; "
                        "rewards: completions sampled for the prompts of --data, scored by reward functions; "
                        "reward: a reward model's loss, accuracy, margin and rewards over preference pairs "
                        "(default: the --checkpoint run's task: dpo or kto for such a run, rewards for a "
                        "grpo run, else lm)")
    p.add_argument("--reward-funcs", default=None, metavar="FILE.py:FN,...",
                   help="--task rewards: reward functions, TRL's signature (default: the grpo run's)")
    p.add_argument("--reward-weights", default=None, metavar="W,...",
                   help="--task rewards: their weights (default: the run's, else 1 each)")
    p.add_argument("--num-generations", type=int, default=None, metavar="N",
                   help="--task rewards: completions sampled per prompt (default: the grpo run's, else 1; "
                        "1 at --temperature 0)")
    p.add_argument("--max-completion-length", type=int, default=None, metavar="N",
                   help="--task rewards: tokens sampled per completion (default: the run's, else half --seq-len)")
    p.add_argument("--temperature", type=float, default=None,
                   help="--task rewards: sampling temperature, 0 for greedy (default: the run's, else 1)")
    p.add_argument("--top-k", type=int, default=None, help="--task rewards: sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="--task rewards: nucleus sampling's mass")
    p.add_argument("--reference", default=None, metavar="DIR",
                   help="--task dpo/kto: the reference model, a run or HF dir (default: the run's --reference, "
                        "else its --init-from)")
    p.add_argument("--target-delimiter", default=None, metavar="TEXT",
                   help="multiple-choice: what joins context and choice, as lm-evaluation-harness's "
                        "target_delimiter; spaces the data writes at that seam are replaced by it "
                        "(default: ' ')")
    p.add_argument("--split", default="all", choices=("all", "train", "eval"),
                   help="all rows of --data, or the documents that training with --eval-fraction "
                        "and --seed kept (train) or held out (eval) (default: all)")
    p.add_argument("--eval-fraction", type=float, default=None,
                   help="for --split (default: the --checkpoint run's)")
    p.add_argument("--seed", type=seed_arg, default=None, help="for --split (default: the run's, else 0)")
    p.add_argument("--text-column", default=None, help="column holding the documents (default: "
                   "the run's columns, else text)")
    p.add_argument("--prompt-column", default=None, help="prompt/completion rows: the prompt column (no loss)")
    p.add_argument("--completion-column", default=None, help="prompt/completion rows: the completion column")
    p.add_argument("--chat-column", default=None,
                   help="conversations ({role, content} lists): loss on the assistant turns only")
    p.add_argument("--add-bos", action="store_true",
                   help="start every text with bos (default: as the run did, else when the "
                        "tokenizer itself adds it)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="sequences per batch (default: a multiple of the device count, at least 8)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (default: lm the run's, else min(2048, "
                        "max_position_embeddings); "
                        "multiple-choice the longest sequence, rounded up to a multiple of 8)")
    p.add_argument("--out", default=None, metavar="JSON", help="write the metrics to this JSON file")
    _add_step_arg(p)
    _add_sharding_args(p, "float32 for --hf, the checkpoint's for --checkpoint")


def cmd_eval(args) -> int:
    """Print (and with --out write as JSON) a model's metrics over a whole split."""
    import dataclasses

    from shardzoo.train import evaluate
    from shardzoo.values import coerce

    fields = {f.name for f in dataclasses.fields(evaluate.EvalSettings)}
    given = {k: v for k, v in vars(args).items() if k in fields}
    for name, tp in (("reward_funcs", tuple[str, ...]), ("reward_weights", tuple[float, ...])):
        if given.get(name) is not None:  # comma-separated, as train's
            given[name] = coerce(given[name], tp, f"--{name.replace('_', '-')}")
    metrics = evaluate.run(evaluate.EvalSettings(**given))
    print(evaluate.format_metrics(metrics))
    return 0


# --------------------------------------------------------------------------- export-lora
def add_export_lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a shardzoo LoRA run or checkpoint dir")
    p.add_argument("out", metavar="OUT_DIR", help="the PEFT adapter dir to write")
    p.add_argument("--base", metavar="NAME_OR_PATH",
                   help="base_model_name_or_path to record (default: the run's --init-from)")
    p.add_argument("--overwrite", action="store_true", help="write into OUT_DIR even when it is not empty")
    _add_step_arg(p)
    p.add_argument("--rules", default=None, metavar="NAME|FILE",
                   help="rule table to load with (default: as generate's)")
    p.add_argument("--mesh", default=None, metavar="SPEC", help="mesh spec to load on (default: as generate's)")


def cmd_export_lora(args) -> int:
    """Write a LoRA run's adapters as a PEFT adapter dir (adapter_config.json + safetensors)."""
    from shardzoo.train.defaults import mesh_and_rules
    from shardzoo.train.io import lora_io

    mesh, rules = mesh_and_rules(args.mesh, args.rules)
    conf = lora_io.export_lora(args.checkpoint, args.out, mesh, rules, step=args.step, base=args.base,
                               overwrite=args.overwrite)
    print(f"exported rank-{conf['r']} LoRA adapters on {','.join(conf['target_modules'])} to {args.out}")
    return 0


# --------------------------------------------------------------------------- main
COMMANDS = {
    "plan": (add_plan_args, cmd_plan, "show where every array lives and what it costs per device"),
    "advise": (add_advise_args, cmd_advise, "rank rule tables and mesh shapes for a model on N devices"),
    "train": (add_train_args, cmd_train, "train a model under a rule table on a mesh"),
    "generate": (add_generate_args, cmd_generate, "generate text from a checkpoint or an HF model"),
    "import-hf": (add_import_hf_args, cmd_import_hf, "convert a Hugging Face checkpoint to shardzoo"),
    "export-hf": (add_export_hf_args, cmd_export_hf, "convert a shardzoo checkpoint to Hugging Face"),
    "export-lora": (add_export_lora_args, cmd_export_lora, "write a LoRA run's adapters as a PEFT adapter dir"),
    "eval": (add_eval_args, cmd_eval, "loss, perplexity, accuracy or multiple-choice accuracy of a model"),
    "plot": (add_plot_args, cmd_plot, "draw the loss curves of a run to a PNG"),
    "data": (add_data_args, cmd_data, "show how data flags tokenize, pack and mask: tokens, which train, rows, truncation"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors: one line, status 2
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shardzoo", description="A Flax model zoo with pluggable sharding rules.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (add_args, run, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(_run=run)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args._run(args) or 0
    except UserError as e:
        print(f"shardzoo {args.command}: error: {e}", file=sys.stderr)
        return 2
    except EnvironmentFault as e:
        print(f"shardzoo {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"shardzoo {args.command}: interrupted (Ctrl-C); nothing more was saved", file=sys.stderr)
        return 130
