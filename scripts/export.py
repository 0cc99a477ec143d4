"""Export a heads folder to another engine's layout.

python scripts/export.py DIR_OR_REPO_ID --to vllm|sglang|tgi|trtllm --out OUT_DIR [--base-name ID]

TensorRT-LLM's Medusa converter takes the head and layer counts from its own flags: pass it
`--num_medusa_heads K --num_medusa_layers L` when the heads are not 4 of 1 layer each.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from heads.export import TARGETS, ExportError, export_heads
from train.console import warnings_as_lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "heads", help="a heads folder (config.json + model.safetensors) or a Hub repo id"
    )
    parser.add_argument("--to", required=True, choices=TARGETS, help="target engine")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument(
        "--base-name",
        help="tgi: the base's Hub id or path as TGI sees it (default: the one the heads record)",
    )
    args = parser.parse_args(argv)
    try:
        out = export_heads(args.heads, args.to, args.out, args.base_name)
    except (ExportError, FileNotFoundError, ValueError) as e:
        print(f"export failed: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.to} layout to {out}")
    if args.to == "trtllm":  # its converter assumes 4 heads of 1 layer unless told
        config = json.loads((Path(out) / "config.json").read_text())
        heads, layers = config["medusa_num_heads"], config["medusa_num_layers"]
        if (heads, layers) != (4, 1):
            print(
                "TensorRT-LLM's convert_checkpoint.py needs "
                f"--num_medusa_heads {heads} --num_medusa_layers {layers} for these heads"
            )
    return 0


if __name__ == "__main__":
    with warnings_as_lines():  # a library warning as one line
        raise SystemExit(main())
