"""Convert an HF checkpoint (BF16/FP32) into the NVFP4 checkpoint SGLang serves on Blackwell
(`--quantization modelopt_fp4`), with nvidia-modelopt's own quantize-and-export (CPU or GPU).

Every Linear of the transformer blocks becomes NVFP4 (E2M1 weights in 1x16 blocks with E4M3 block
scales and an FP32 global scale; activations NVFP4 with a calibrated FP32 input scale);
embeddings and lm_head stay as they are. Activation scales are calibrated on the lines of
--calib-file (tokenized with the checkpoint's tokenizer). The written folder is checked against
SGLang 0.5.23's modelopt_fp4 loader layout. Needs `pip install 'megatron_rl[modelopt]'`.

examples:
  python tools/convert_hf_to_nvfp4.py --hf-dir Qwen3-8B --out-dir Qwen3-8B-NVFP4 --calib-file prompts.txt
  python -m sglang.launch_server --model-path Qwen3-8B-NVFP4 --quantization modelopt_fp4   # Blackwell
"""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_rl.convert import cli
from megatron_rl.convert.hf_to_nvfp4 import convert_hf_to_nvfp4


def calibration_batches(hf_dir: str, calib_file: str, max_tokens: int) -> list:
    """Token id tensors [1, S] int64, one per non-empty line of calib_file."""
    from transformers import AutoTokenizer

    lines = [line for line in Path(calib_file).read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"--calib-file {calib_file} has no non-empty line")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    return [tokenizer(line, return_tensors="pt", truncation=True, max_length=max_tokens)["input_ids"]
            for line in lines]


def main(argv: list[str] | None = None) -> int:
    parser = cli.make_parser(__doc__)
    parser.add_argument("--hf-dir", required=True, help="HF model folder (config.json, weights, tokenizer)")
    parser.add_argument("--out-dir", required=True, help="folder to create (written atomically)")
    parser.add_argument("--calib-file", required=True, help="text file, one calibration prompt a line")
    parser.add_argument("--calib-max-tokens", type=int, default=512, help="tokens kept per line (default 512)")
    cli.add_common(parser)
    args = parser.parse_args(argv)
    return cli.run("convert_hf_to_nvfp4", lambda: convert_hf_to_nvfp4(
        args.hf_dir, args.out_dir, calibration_batches(args.hf_dir, args.calib_file, args.calib_max_tokens),
        overwrite=args.overwrite))


if __name__ == "__main__":
    sys.exit(main())
