"""The decode loop's named settings: their choices and defaults, in one torch-free place.

`Runner`, the command-line options (`--lookup`, `--verify-length`; `--help` needs no torch), `profile`'s
`ProfileOptions` and `label`'s `LabelJob` all start from these, so a request decodes alike whichever made it.
"""

LOOKUPS = ("greedy", "all", "off")  # which requests may copy drafts (`runtime.lookup`): every one, T = 0 only, none
DEFAULT_LOOKUP = "all"  # session 39: +2.6% at T = 1 on the standing benchmark

VERIFY_LENGTHS = ("adaptive", "full")  # how many rows of a drafted block a step verifies (`Runner.verify_length`)
DEFAULT_VERIFY_LENGTH = "adaptive"  # session 38: +2.6-3.1% at T = 0 on the standing benchmark
