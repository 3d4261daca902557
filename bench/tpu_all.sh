#!/usr/bin/env bash
# Everything measured on one TPU v5e chip, in one command per part (each under the device tool's
# 10-minute limit); results go to $OUT (or bench/results/tpu_run/) as they finish.
#
#   bash bench/tpu_all.sh install tests              # the machine's install, then tests/tpu
#   bash bench/tpu_all.sh install train              # a tiny `shardzoo train` run, its output kept
#   bash bench/tpu_all.sh install mfu:llama,gemma     # rows of bench/tpu_mfu.py
#   bash bench/tpu_all.sh install decode:llama3.2-1b moe decodeprof:llama3.2-1b:32:scan
#   bash bench/tpu_all.sh install profile:llama3.2-1b:2x2048:save_qkv_mlp
#   bash bench/tpu_all.sh install profile:qwen3-30b-a3b:4x2048:save_attn_mlp:num_hidden_layers=4,num_local_experts=32,moe_dispatch=auto
#   bash bench/tpu_all.sh install decodevmem:qwen3-0.6b:0 decodevmem:qwen3-0.6b:114688   # libtpu scoped VMEM A/B
#
#   bash bench/tpu_all.sh install cpubench           # issue 39's CPU rows on the TPU host's own CPU, 2 cores
#   bash bench/tpu_all.sh install "decodevar:qwen3-0.6b:32:scan:decode_vmem_kib=-1;decode_vmem_kib=0"   # config A/B
#   bash bench/tpu_all.sh install "decodeflags:llama3.2-1b:1:unroll:default;--xla_tpu_sliced_prefetch_max_slices=0"
#
# Parts run in order until TPU_DEADLINE_S (585) seconds from the start; set it lower with a shorter
# device timeout. Each part's own timeout is cut to what is left.
#
# install: the recipe of shared/TPU.md (the machine's own package index, /tmp/site after its jax).
# Run every part through this script: the machine's PYTHONPATH holds its TPU jax, and a command
# that replaces PYTHONPATH instead of adding to it silently runs on the CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results/tpu_run}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# The device tool ends a command at 10 minutes and a killed pipeline prints nothing, so each part's
# timeout is cut to what is left of TPU_DEADLINE_S (from this script's start), and a part that
# would start with under 20 s left is skipped, named: what ran before it still prints.
deadline=${TPU_DEADLINE_S:-585}
cap() { local left=$((deadline - SECONDS - 5)); echo $(( left < $1 ? left : $1 )); }
for part in "$@"; do
  if [ "$part" != install ] && [ "$(cap 20)" -lt 20 ]; then
    echo "skipped $part: ${SECONDS}s of TPU_DEADLINE_S=${deadline} spent"; continue
  fi
  case "$part" in
    install)
      if [ ! -d /tmp/site/flax ]; then
        PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
          --index-url file:///opt/pypi/simple --target /tmp/site flax optax orbax-checkpoint einops \
          datasets pyarrow pyyaml safetensors tokenizers jinja2 tqdm tensorboardX matplotlib pytest 2>&1 | tail -3
      fi
      mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/shardzoo
      export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site:/tmp/pkg
      python3 -c "import jax, flax, datasets, pyarrow; print(jax.devices(), jax.__version__, flax.__version__, datasets.__version__, pyarrow.__version__)"
      python3 -c "import jax; assert jax.default_backend() == 'tpu', 'no TPU: is the machine PYTHONPATH kept?'" || exit 3
      ;;
    tests|tests:*)
      sel=${part#tests}; sel=${sel#:}
      JAX_PLATFORMS=tpu timeout $(cap 540) python3 -m pytest -v -p no:cacheprovider -rA tests/tpu ${sel:+-k "$sel"} 2>&1 \
        | tee "$out/tpu_tests.log" | tail -60
      ;;
    train)  # a tiny `shardzoo train` run as a user starts it, its whole output kept (issue 34 asks for it in the note)
      rm -rf /tmp/tiny_run
      timeout $(cap 300) python3 -m shardzoo train --out /tmp/tiny_run --model llama-tiny --override dtype=bfloat16 \
        --steps 20 --warmup-steps 2 --batch-size 16 --seq-len 128 --log-every 2 --eval-every 0 2>&1 | tee "$out/tpu_train_tiny.log" | tail -45
      ;;
    mfu:*)  # files named without commas: the device tool returns no file with one in its name
      rows=${part#mfu:}; name=${rows//,/_}
      timeout $(cap 560) python3 bench/tpu_mfu.py --only "$rows" --steps 5 --timeout $(cap 300) \
        --out "$out/tpu_mfu_$name.md" > "$out/tpu_mfu_$name.log" 2>&1
      cat "$out/tpu_mfu_$name.md"; grep -E "^batch|fits|Error|error" "$out/tpu_mfu_$name.log" | tail -30
      ;;
    profile:*)  # profile:MODEL:BxS:REMAT[:K=V,K=V] -- where the step's device time goes (bench/profile_ops.py)
      IFS=: read -r _ model shape remat kvs <<< "$part"
      overrides=(); IFS=, read -ra pairs <<< "${kvs:-}"
      for kv in "${pairs[@]}"; do overrides+=(--override "$kv"); done
      timeout $(cap 400) python3 bench/gpu_mfu.py --model "$model" --param-dtype bfloat16 --candidates "$shape:$remat" \
        "${overrides[@]}" --steps 3 --profile /tmp/trace_$model --out "$out/tpu_profile_$model.md" 2>&1 | tail -60
      ;;
    decode:*)
      timeout $(cap 400) python3 bench/bench_decode_depth.py --models "${part#decode:}" --dtype bfloat16 --batches 1,32 \
        --prompt 128 --new 256 --layers 0 --out "$out/tpu_decode_${part#decode:}.md" 2>&1 | tail -20
      ;;
    decodeprof:*)  # decodeprof:MODEL:BATCH:scan|unroll -- where a generate call's device time goes
      IFS=: read -r _ model batch mode <<< "$part"
      timeout $(cap 400) python3 bench/bench_decode_depth.py --models "$model" --dtype bfloat16 --batches "$batch" \
        --prompt 128 --new 256 --layers 0 --scan "$mode" --profile /tmp/dtrace --hlo "$out/hlo" 2>&1 \
        | tee "$out/tpu_decodeprof_${model}_${batch}_${mode}.log" | tail -60
      ;;
    decodevmem:*)  # decodevmem:MODEL:KIB -- batch-32 unrolled decoding with libtpu's scoped VMEM at KIB (0: default)
      IFS=: read -r _ model kib <<< "$part"
      flag=""; [ "$kib" != 0 ] && flag="--xla_tpu_scoped_vmem_limit_kib=$kib"
      LIBTPU_INIT_ARGS="${LIBTPU_INIT_ARGS:-} $flag" timeout $(cap 300) python3 bench/bench_decode_depth.py --models "$model" \
        --dtype bfloat16 --batches 32 --prompt 128 --new 256 --layers 0 --scan unroll 2>&1 | grep "^| $model" | head -1
      ;;
    decodeflags:*)  # decodeflags:MODEL:BATCHES:scan|unroll:SET;SET -- libtpu flag sets A/B (a fresh process each;
      # a set's flags are space-separated, "default" for none), e.g. the memory-bound loop optimizer:
      # "decodeflags:llama3.2-1b:1:unroll:default;--xla_tpu_memory_bound_loop_optimizer_options=enabled:true"
      IFS=: read -r _ model batches mode sets <<< "$part"
      IFS=';' read -ra flagsets <<< "$sets"
      for set in "${flagsets[@]}"; do
        [ "$set" = default ] && set=""
        echo "flags: ${set:-none (the defaults)}"
        LIBTPU_INIT_ARGS="${LIBTPU_INIT_ARGS:-} $set" timeout $(cap 300) python3 bench/bench_decode_depth.py --models "$model" \
          --dtype bfloat16 --batches "$batches" --prompt 128 --new 256 --layers 0 --scan "$mode" 2>&1 \
          | grep -E "^\| $model|Error" | awk '!seen[$0]++'
      done
      ;;
    decodevar:*)  # decodevar:MODEL:BATCHES:scan|unroll|both:VARIANTS -- a row per ';'-separated override set
      IFS=: read -r _ model batches mode variants <<< "$part"
      timeout $(cap 560) python3 bench/bench_decode_depth.py --models "$model" --dtype bfloat16 --batches "$batches" \
        --prompt 128 --new 256 --layers 0 --scan "$mode" --variants "$variants" 2>&1 \
        | tee "$out/tpu_decodevar_${model}_${batches//,/-}_${mode}.log" | grep --line-buffered -E "^\| $model|Error"
      ;;
    gather)  # the MoE sorted dispatch's row gathers and their gradients, written several ways (bench/tpu_gather.py)
      timeout $(cap 200) python3 bench/tpu_gather.py --tokens 8192 --k 8 --embed 2048 2>&1 | tee "$out/tpu_gather.log" | tail -12
      ;;
    kvlayout)  # the decoding cache's layout chosen by XLA, plain against packed (bench/tpu_kv_layout.py)
      timeout $(cap 200) python3 bench/tpu_kv_layout.py 2>&1 | tail -4
      ;;
    cpubench)  # issue 39's CPU rows on this machine's host CPU (not the chip): its model and ISA first, then the
      # train step and decoding against transformers, pinned to 2 cores as the issue measured (torch from /opt/wheels)
      grep -m1 "model name" /proc/cpuinfo; nproc
      grep -m1 -o -wE "avx512f|avx512_bf16|amx_bf16|amx_tile" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
      if [ ! -d /tmp/site/torch ]; then
        PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple \
          --find-links /opt/wheels --target /tmp/site torch==2.13.0 transformers 2>&1 | tail -3
      fi
      JAX_PLATFORMS=cpu timeout $(cap 330) taskset -c 0,1 python3 bench/bench_cpu.py --rounds 3 --only default \
        --out "$out/cpu_host.md" 2>&1 | grep -vE "warn" | tail -30
      JAX_PLATFORMS=cpu timeout $(cap 240) taskset -c 0,1 python3 bench/bench_decode.py --rounds 2 \
        --out "$out/cpu_host_decode.md" 2>&1 | grep -vE "warn" | tail -20
      ;;
    moe)
      JAX_PLATFORMS=tpu timeout $(cap 300) python3 bench/bench_moe.py --settings qwen3-30b-a3b --embed 2048 --batch 8 \
        --length 1024 --dtype bfloat16 --rounds 3 --iters 2 --out "$out/tpu_moe.md" 2>&1 | tail -20
      ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
