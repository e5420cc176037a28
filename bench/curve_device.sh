#!/usr/bin/env bash
# On the GPU machine: configs/shakespeare_char.toml (nanoGPT's train_shakespeare_char
# settings: init "nanogpt", dropout 0.2 on embeddings, branches and attention
# probabilities) trained STEPS (1000) steps by Doppler for each seed in SEEDS, and the same
# runs in PyTorch (bench/nanogpt_curve.py: nanoGPT's model, init and dropout); f32
# everywhere. Doppler's runs and PyTorch's run side by side (the curves, not the times,
# are the point). Expects target/release/doppler and the Vulkan loader unpacked. Writes
# $OUT/doppler_<seed>.jsonl, $OUT/torch_<seed>.jsonl and a table on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}"
steps="${STEPS:-1000}"
seeds="${SEEDS:-1337 1 2}"
(
  for s in $seeds; do
    sed -e "s/^seed = 1337/seed = $s/" -e "s|^out_dir = .*|out_dir = \"../runs/curve_$s\"|" \
      configs/shakespeare_char.toml > "configs/.curve_$s.toml"
    ./target/release/doppler train --config "configs/.curve_$s.toml" --max-steps "$steps" --json \
      > "$out/doppler_$s.jsonl" 2> "$out/doppler_$s.log" || echo "doppler seed $s failed"
  done
) &
for s in $seeds; do
  python3 bench/nanogpt_curve.py --steps "$steps" --seed "$s" > "$out/torch_$s.jsonl" 2> "$out/torch_$s.log" \
    || echo "torch seed $s failed"
done
wait
python3 - "$out" $seeds <<'PY'
import json, sys
out, seeds = sys.argv[1], sys.argv[2:]
def evals(path):
    r = {}
    for line in open(path):
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if "eval" in (d.get("type"), d.get("event")):
            r[d["step"]] = d.get("val_loss", d.get("valLoss"))
    return r
runs = {(who, s): evals(f"{out}/{who}_{s}.jsonl") for who in ("doppler", "torch") for s in seeds}
steps = sorted(set().union(*[set(v) for v in runs.values()]))
print("| step | Doppler (" + " ".join(seeds) + ") | mean | PyTorch | mean |")
for st in steps:
    row = [str(st)]
    for who in ("doppler", "torch"):
        vals = [runs[(who, s)].get(st) for s in seeds]
        ok = [v for v in vals if v is not None]
        row.append(" ".join(f"{v:.4f}" if v is not None else "-" for v in vals))
        row.append(f"{sum(ok) / len(ok):.4f}" if ok else "-")
    print("| " + " | ".join(row) + " |")
PY
