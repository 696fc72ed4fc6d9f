# The decode A/B of benchmarks/README.md ("GPU on an H100, fourth time"), as it ran on the device
# machine from the repository root: the code before (`git archive 6f053b0 areal_flow scripts`
# unpacked into .ab/old) and after (the working tree) in alternating processes on one
# Qwen2.5-0.5B-shaped model; decode_ab_one.py was .ab/one.py. The wheels of scripts/gpu_wheels.txt
# in .gpu_wheels/. Output: $OUT/ab.jsonl (decode_ab.jsonl here).
set -e
site=$(mktemp -d)
python -m pip install -q --no-deps --no-index --target "$site" .gpu_wheels/*.whl
export PYTHONPATH="$site" PYTHONUNBUFFERED=1
folder=$(mktemp -d)
read model params < <(python -c "
import sys; sys.path[:0]=['.','scripts']
from pathlib import Path; import gpu_check
p, n = gpu_check.build_model('cuda', Path('$folder')); print(p, n)")
for rep in 1 2; do for tree in .ab/old $PWD; do
  python .ab/one.py $( [ $tree = .ab/old ] && echo $PWD/.ab/old || echo $PWD ) "$model" "$params" 2>/dev/null | tail -1 | tee -a $OUT/ab.jsonl
done; done
