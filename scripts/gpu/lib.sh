# Shell functions shared by the device-call scripts in this folder (source it; python3 must import blockpilot).

# drop_broken_lines FILE: an answering run killed mid-write can leave one broken last line in a JSONL file.
drop_broken_lines() {
  python3 - "$1" <<'PY'
import json, sys
lines = open(sys.argv[1]).read().splitlines()
good = []
for line in lines:
    try:
        json.loads(line); good.append(line)
    except ValueError:
        pass
open(sys.argv[1], "w").write("".join(l + "\n" for l in good))
print(f"{len(good)} answers ({len(lines) - len(good)} broken lines dropped)")
PY
}

# package_from_checkpoint OUT_DIR CHECKPOINT_DIR: a training run stopped before it wrote OUT_DIR is saved (fp16)
# from its last checkpoint, with its training log.
package_from_checkpoint() {
  python3 - "$1" "$2" <<'PY'
import pathlib, sys
from blockpilot.models.checkpoint import load_drafter, save_drafter
out, ckpt = map(pathlib.Path, sys.argv[1:])
if not (out / "model.safetensors").is_file() and (ckpt / "model.safetensors").is_file():
    log = ckpt.parent / "train_log.json"
    save_drafter(load_drafter(ckpt).half(), out,
                 extra_files={"training_log.json": log.read_text()} if log.is_file() else None)
    print(f"{out}: packaged from the last checkpoint")
PY
}
