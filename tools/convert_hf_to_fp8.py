"""Convert an HF checkpoint (BF16/FP32) into an HF FP8 blockwise checkpoint that SGLang serves.

Linear weights become float8_e4m3fn `X.weight` plus float32 `X.weight_scale_inv` (one scale per
block, default 128x128); embeddings, norms and lm_head stay as they are (the precision contract's
high-precision list); config.json gains quantization_config {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [...]} (+ "scale_fmt": "ue8m0" with
--scale-format ue8m0, power-of-two scales for DeepGEMM / Blackwell). Streams tensor by tensor.
See docs/convert.md.

examples:
  python tools/convert_hf_to_fp8.py --hf-dir Qwen3-8B --out-dir Qwen3-8B-FP8
  python tools/convert_hf_to_fp8.py --hf-dir Qwen3-8B --out-dir Qwen3-8B-FP8-ue8m0 --scale-format ue8m0
  python -m sglang.launch_server --model-path Qwen3-8B-FP8      # then serve it (GPU)
"""

from __future__ import annotations

import sys

from megatron_rl.convert import cli
from megatron_rl.convert.hf_to_fp8 import DEFAULT_MAX_SHARD_BYTES, convert_hf_to_fp8
from megatron_rl.fp8.rollout_quant import RolloutQuantSpec


def main(argv: list[str] | None = None) -> int:
    parser = cli.make_parser(__doc__)
    parser.add_argument("--hf-dir", required=True, help="HF model folder (config.json + *.safetensors)")
    parser.add_argument("--out-dir", required=True, help="folder to create (written atomically)")
    parser.add_argument("--block-size", type=int, nargs=2, default=[128, 128], metavar=("ROWS", "COLS"),
                        help="weight scale block (default: 128 128)")
    parser.add_argument("--scale-format", choices=("fp32", "ue8m0"), default="fp32",
                        help="fp32 block scales (Hopper) or power-of-two ue8m0 (DeepGEMM/Blackwell)")
    parser.add_argument("--high-precision", nargs="+", default=list(RolloutQuantSpec.high_precision),
                        metavar="SUBSTRING", help="tensor-name substrings kept unquantized "
                        "(default: %(default)s)")
    parser.add_argument("--max-shard-size", type=cli.parse_size, default=DEFAULT_MAX_SHARD_BYTES,
                        help="largest safetensors file, e.g. 5GB (default), 2GiB")
    cli.add_common(parser)
    args = parser.parse_args(argv)
    return cli.run("convert_hf_to_fp8", lambda: convert_hf_to_fp8(
        args.hf_dir, args.out_dir, block_size=tuple(args.block_size), scale_format=args.scale_format,
        high_precision=tuple(args.high_precision), max_shard_bytes=args.max_shard_size,
        overwrite=args.overwrite, progress=not args.no_progress))


if __name__ == "__main__":
    sys.exit(main())
