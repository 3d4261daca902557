"""The command line: one function per subcommand, each a thin call into the library.

A ``UserError`` (bad flag, file, rule, mesh, model or data) prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import sys

from shardzoo.sharding.errors import UserError


# --------------------------------------------------------------------------- plan
def add_plan_args(p: argparse.ArgumentParser) -> None:
    pass  # filled by the plan work


def cmd_plan(args) -> int:
    raise NotImplementedError


# --------------------------------------------------------------------------- train
def add_train_args(p: argparse.ArgumentParser) -> None:
    pass  # filled by the trainer work


def cmd_train(args) -> int:
    raise NotImplementedError


# --------------------------------------------------------------------------- plot
def add_plot_args(p: argparse.ArgumentParser) -> None:
    pass  # filled by the trainer work


def cmd_plot(args) -> int:
    raise NotImplementedError


# --------------------------------------------------------------------------- generate
def add_generate_args(p: argparse.ArgumentParser) -> None:
    pass  # filled by the HF interop work


def cmd_generate(args) -> int:
    raise NotImplementedError


# --------------------------------------------------------------------------- import-hf / export-hf
def add_import_hf_args(p: argparse.ArgumentParser) -> None:
    pass  # filled by the HF interop work


def cmd_import_hf(args) -> int:
    raise NotImplementedError


def add_export_hf_args(p: argparse.ArgumentParser) -> None:
    pass  # filled by the HF interop work


def cmd_export_hf(args) -> int:
    raise NotImplementedError


# --------------------------------------------------------------------------- main
COMMANDS = {
    "plan": (add_plan_args, cmd_plan, "show where every array lives and what it costs per device"),
    "train": (add_train_args, cmd_train, "train a model under a rule table on a mesh"),
    "generate": (add_generate_args, cmd_generate, "generate text from a checkpoint or an HF model"),
    "import-hf": (add_import_hf_args, cmd_import_hf, "convert a Hugging Face checkpoint to shardzoo"),
    "export-hf": (add_export_hf_args, cmd_export_hf, "convert a shardzoo checkpoint to Hugging Face"),
    "plot": (add_plot_args, cmd_plot, "draw the loss curves of a run to a PNG"),
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
    except KeyboardInterrupt:
        return 130
