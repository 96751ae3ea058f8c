"""Convert a Megatron-Core distributed checkpoint (torch_dist) into an HF safetensors folder.

Reads folders written by tools/convert_hf_to_megatron.py and the trainer's own checkpoints
(checkpoints/step_NNNNNN/model, saved at any TP/PP; the optimizer state is ignored). No GPU, no
Megatron and no process group needed: the checkpoint is read tensor by tensor, one layer at a
time. Writes sharded model-*.safetensors, model.safetensors.index.json, config.json and the
tokenizer files, loadable by transformers' from_pretrained. See docs/convert.md.

--ckpt-dir accepts the torch_dist folder itself, a step folder holding model/, or a checkpoints
root holding a `latest` file (its newest step). --hf-config-dir (the HF folder the run started
from) is needed for trainer checkpoints; folders from convert_hf_to_megatron carry their config.

examples:
  python tools/convert_megatron_to_hf.py --ckpt-dir ckpt/qwen2.5-7b-tp4 --out-dir hf/qwen2.5-7b
  python tools/convert_megatron_to_hf.py --ckpt-dir runs/dapo/checkpoints --hf-config-dir Qwen2.5-7B \
      --out-dir hf/dapo-latest --dtype bf16 --max-shard-size 2GB
"""

from __future__ import annotations

import sys

from megatron_rl.convert import cli
from megatron_rl.convert.megatron_to_hf import DEFAULT_MAX_SHARD_BYTES, DTYPES, convert_megatron_to_hf


def main(argv: list[str] | None = None) -> int:
    parser = cli.make_parser(__doc__)
    parser.add_argument("--ckpt-dir", required=True, help="torch_dist folder, step folder or checkpoints root")
    parser.add_argument("--out-dir", required=True, help="HF folder to create (written atomically)")
    parser.add_argument("--hf-config-dir", default=None,
                        help="HF folder with config.json and tokenizer (default: carried by the checkpoint)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="output dtype (default: the stored dtype)")
    parser.add_argument("--max-shard-size", type=cli.parse_size, default=DEFAULT_MAX_SHARD_BYTES,
                        help="largest safetensors file, e.g. 5GB (default), 2GiB")
    cli.add_common(parser)
    args = parser.parse_args(argv)
    return cli.run("convert_megatron_to_hf", lambda: convert_megatron_to_hf(
        args.ckpt_dir, args.out_dir, hf_config_dir=args.hf_config_dir, dtype=args.dtype,
        max_shard_bytes=args.max_shard_size, overwrite=args.overwrite, progress=not args.no_progress))


if __name__ == "__main__":
    sys.exit(main())
