"""GSM8K GRPO recipe — not written yet.

The training loop needs the local engine, the rollout scheduler, the runtime and the algorithms
(issues 3 to 8). Until they land this file only says so, so that the README's run command
reports the project's state honestly instead of failing with a missing file.
"""

import sys

if __name__ == "__main__":
    sys.exit(
        "recipes/gsm8k_grpo.py is not implemented yet: the GRPO training loop lands with the "
        "recipe issue (see README.md, 'Status'). Today `pytest` and `areal-flow plugins` work."
    )
