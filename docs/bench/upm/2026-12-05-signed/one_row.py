"""One row of `agora bench upm --sections training` (agora.bench.upm.training_rows), seed and mode from argv."""
import json, sys
from agora.bench.upm import training_rows
from agora.config import load_manifest
seed, modes = int(sys.argv[1]), tuple(sys.argv[2].split(","))
print(json.dumps(training_rows(load_manifest("small"), 40, 2, modes, (seed,))), flush=True)
