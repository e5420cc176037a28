#!/bin/bash
# Conv nets on the GPU machine (session 25, docs/benchmarks.md): `doppler verify --filter
# conv2d` (both paths), then images/s of four configs in f32 and with f16 operands
# (DOPPLER_MATMUL=f16, dynamic loss scale) against PyTorch eager f32 and bf16 autocast from
# the same step-0 weights (bench/torch_convnet.py speed), twice; then one 3x3 conv's
# forward + backward against cuDNN (doppler bench kernels, bench/torch_convnet.py conv).
# The configs: the shipped digits classifier and U-Net, and a classifier and a U-Net of
# 64/128/256 channels on 3x32x32 images (random pixels: the speed does not depend on them).
# Run from the project root with the binary at $DOPPLER_BIN (default target/release/doppler)
# and the digits CSV at data/digits/digits.csv (scripts/fetch_digits.sh); results in $OUT.
set -u
B=${DOPPLER_BIN:-$PWD/target/release/doppler}
OUT=${OUT:-/tmp/conv_out}
mkdir -p "$OUT" /tmp/u32
$B verify --filter conv2d > "$OUT/verify.txt" 2>&1
tail -1 "$OUT/verify.txt"
python3 - <<'PY'
import random
random.seed(0)
with open('/tmp/u32/images.csv', 'w') as f:
    for i in range(256):
        f.write(','.join(str(random.randrange(256)) for _ in range(3 * 32 * 32)) + ',' + str(i % 10) + '\n')
PY
for arch in unet convnet; do
  if [ $arch = unet ]; then extra='timesteps = 200'; bs=64; else extra=''; bs=128; fi
  cat > /tmp/u32/$arch.toml <<TOML
[model]
arch = "$arch"
in_channels = 3
image_size = 32
classes = 10
channels = [64, 128, 256]
blocks = 1
groups = 8
$extra

[data]
images = "/tmp/u32/images.csv"
pixel_max = 255
val_fraction = 0.1

[train]
batch_size = $bs
steps = 100
lr = 1e-3
warmup = 10
grad_clip = 1.0
loss_scale = "dynamic"
eval_interval = 100
checkpoint_interval = 100
seed = 1
out_dir = "/tmp/u32/run_$arch"
TOML
  $B train --config /tmp/u32/$arch.toml --max-steps 0 > /dev/null 2>&1
  cp /tmp/u32/$arch.toml /tmp/u32/${arch}16.toml
done
for c in digits_cnn digits_unet; do
  sed "s#../runs/$c#/tmp/init_$c#; s#../data/digits#$PWD/data/digits#" configs/$c.toml > /tmp/$c.toml
  $B train --config /tmp/$c.toml --max-steps 0 > /dev/null 2>&1
  sed 's/^grad_clip = 1.0$/grad_clip = 1.0\nloss_scale = "dynamic"/' /tmp/$c.toml > /tmp/${c}16.toml
done
for i in 1 2; do
for a in u32/unet u32/convnet digits_cnn digits_unet; do
  $B bench train --config /tmp/$a.toml --steps 30 2>&1 | grep "K images"
  DOPPLER_MATMUL=f16 $B bench train --config /tmp/${a}16.toml --steps 30 > "$OUT/b16_$(basename $a)_$i.txt" 2>&1
  grep "K images" "$OUT/b16_$(basename $a)_$i.txt"
  case $a in u32/*) ck=/tmp/u32/run_$(basename $a);; *) ck=/tmp/init_$a;; esac
  python3 bench/torch_convnet.py speed --checkpoint $ck --steps 30 2>&1
done
done | tee "$OUT/speed.txt"
{ $B bench kernels 2>&1; python3 bench/torch_convnet.py conv 2>&1; } > "$OUT/conv.txt"
grep -i conv2d "$OUT/conv.txt"
