"""More HumanEval-style code prompts for drafter training data: the `stdlib-code` recipe applied to the
documented functions of permissively licensed third-party Python packages installed beside BlockPilot.

Every public top-level function and public method of a public class whose docstring is 20-1,200 characters
becomes "Complete the following Python function" + its signature and docstring in a Python fence (exactly the
`stdlib-code` format). Tests are skipped; a prompt equal to a HumanEval or MT-Bench prompt, to a `stdlib-code`
prompt or to one already answered under `data/` is left out; at most `--per-package` prompts per package; one
per distinct text; shuffled with a fixed seed, so a stopped `blockpilot answer` run resumes over the same order.
The file depends on the installed package versions (the versions are written to the `--out` file's sidecar
`.versions.json`).

    python scripts/package_code_prompts.py --out runs/package-code.jsonl
    blockpilot answer --prompts runs/package-code.jsonl --out runs/package-code-answers.jsonl --batch-size 16
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
from pathlib import Path

from blockpilot.assets.prompts import documented_function_prompts, evaluation_texts, load_stdlib_code
from blockpilot.training.data import read_answer_rows

ROOT = Path(__file__).resolve().parent.parent

# import name -> distribution name; all BSD, MIT, Apache-2.0, PSF-style or HPND licensed
PACKAGES = {
    "sympy": "sympy", "numpy": "numpy", "networkx": "networkx", "mpmath": "mpmath", "transformers": "transformers",
    "torch": "torch", "matplotlib": "matplotlib", "setuptools": "setuptools", "pip": "pip", "openai": "openai",
    "onnxscript": "onnxscript", "fontTools": "fonttools", "huggingface_hub": "huggingface-hub",
    "pydantic": "pydantic", "rich": "rich", "accelerate": "accelerate", "onnx_ir": "onnx-ir", "aiohttp": "aiohttp",
    "PIL": "pillow", "jinja2": "jinja2", "platformdirs": "platformdirs", "fsspec": "fsspec", "anyio": "anyio",
    "psutil": "psutil", "click": "click", "onnx": "onnx", "onnxruntime": "onnxruntime", "polygraphy": "polygraphy",
    "ray": "ray", "fastapi": "fastapi", "starlette": "starlette", "httpx": "httpx", "tqdm": "tqdm",
    "safetensors": "safetensors", "packaging": "packaging", "pygments": "pygments", "dateutil": "python-dateutil",
    "yaml": "pyyaml", "markdown_it": "markdown-it-py", "attr": "attrs", "filelock": "filelock",
}


def _is_test(rel: Path) -> bool:
    return any(part.startswith(("test", "_test")) or part == "tests" for part in rel.parts)


def package_prompts(site: Path, per_package: int, seed: int, skip: set[str]) -> tuple[list[dict], dict]:
    """Prompt rows from the packages under `site` and the versions read."""
    rows, versions, seen = [], {}, set(skip)
    for name, dist in PACKAGES.items():
        root = site / name
        if not root.is_dir():
            continue
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        found = []
        for qualname, text in documented_function_prompts(site, under=root, skip=_is_test):
            if text not in seen:
                seen.add(text)
                found.append({"id": f"pkg/{qualname}", "prompt": text, "source": "package-code", "category": "code"})
        random.Random(f"{seed}/{name}").shuffle(found)
        rows += found[:per_package]
    random.Random(seed).shuffle(rows)
    return rows, versions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--per-package", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    skip = evaluation_texts() | {p.text for p in load_stdlib_code()}
    skip |= {row["prompt"] for path in sorted((ROOT / "data").glob("*.jsonl.gz")) for row in read_answer_rows(path)}
    rows, versions = package_prompts(site, args.per_package, args.seed, skip)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args.out.with_suffix(".versions.json").write_text(json.dumps(versions, indent=1) + "\n")
    print(f"{len(rows)} code prompts from {len(versions)} packages -> {args.out}")


if __name__ == "__main__":
    main()
