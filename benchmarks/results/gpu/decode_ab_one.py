import json, sys
from pathlib import Path
tree, model, params = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
sys.path[:0] = [tree, tree + "/scripts"]
import areal_flow, gpu_check
assert areal_flow.__file__.startswith(str(Path(tree).resolve())), areal_flow.__file__
print(json.dumps({"tree": tree, **gpu_check.decode("cuda", model, params, 2.93e12)}), flush=True)
