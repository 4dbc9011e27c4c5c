"""``torchrun --nproc-per-node K -m replay.parallel --job job.json --result result.json``."""

import sys

from replay.parallel.launch import main

sys.exit(main())
