"""Convert an HF checkpoint (safetensors) into a Megatron-Core distributed checkpoint (torch_dist).

The output folder holds model weights only (no optimizer state), written by this one process
with Megatron's global layout, so it loads at any TP/PP; --tp/--pp are checked against the model
(heads, KV heads, vocab, FFN and layers divisible) and recorded in common.pt. The trainer starts
a fresh optimizer from it. The HF config and tokenizer are kept in OUT/hf/ for the way back.
Supported: Llama 3.x, Qwen2 / Qwen2.5, Qwen3 dense. See docs/convert.md.

examples:
  python tools/convert_hf_to_megatron.py --hf-dir Qwen2.5-7B --out-dir ckpt/qwen2.5-7b-tp4 --tp 4
  python tools/convert_hf_to_megatron.py --hf-dir Llama-3.1-8B --out-dir ckpt/l8b --tp 2 --pp 2 --dtype bf16
"""

from __future__ import annotations

import sys

from megatron_rl.convert import cli
from megatron_rl.convert.hf_to_megatron import DTYPES, convert_hf_to_megatron


def main(argv: list[str] | None = None) -> int:
    parser = cli.make_parser(__doc__)
    parser.add_argument("--hf-dir", required=True, help="HF model folder (config.json + *.safetensors)")
    parser.add_argument("--out-dir", required=True, help="folder to create (written atomically)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size to validate and chunk for")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size to validate for")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="stored dtype (default: each tensor's dtype in the HF files)")
    cli.add_common(parser)
    args = parser.parse_args(argv)
    if args.tp < 1 or args.pp < 1:
        parser.error(f"--tp {args.tp} and --pp {args.pp} must be >= 1")
    return cli.run("convert_hf_to_megatron", lambda: convert_hf_to_megatron(
        args.hf_dir, args.out_dir, tp=args.tp, pp=args.pp, dtype=args.dtype,
        overwrite=args.overwrite, progress=not args.no_progress))


if __name__ == "__main__":
    sys.exit(main())
