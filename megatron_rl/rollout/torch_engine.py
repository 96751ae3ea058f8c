"""The embedded rollout engine: an HF causal LM in-process (CPU or one GPU), SGLang's protocol.

Generation is a batched decode loop over the model's own KV cache: prompts are left-padded, the
attention mask hides the padding, position ids count real tokens only, so a row's numbers do not
depend on its padding. Per step the float32 logits of each row are divided by the temperature,
`log_softmax` gives the row's log-probs, top-p truncates and renormalizes the probabilities that
are sampled from, and the log-prob of the sampled token under the temperature-scaled, untruncated
distribution is returned. That is what SGLang's sampler returns (logprobs after temperature, before
top-p/top-k; greedy = temperature 1) and what the trainer recomputes (log_softmax(logits / T)), so
rollout-vs-trainer mismatch metrics measure numerics, not a definition gap.

A stop token ends its sample and is kept as the last response token (SGLang's output_ids keep it
too); finish_reason is "stop", or "length" at max_new_tokens.

Weights arrive as SGLang would receive them from slime/verl: HF names; linear weights either high
precision (`X.weight`, quantized here when the precision contract says fp8) or already FP8
(`X.weight` float8_e4m3fn + `X.weight_scale_inv` blockwise, or `X.weight_scale` tensorwise);
embeddings, norms and lm_head in high precision. With rollout_quant != "bf16" the linear layers
run W8A8 emulation (megatron_rl.fp8.w8a8), or W4A4 for nvfp4 / mxfp4 (megatron_rl.fp8.w4a4; their
weights always arrive in high precision and are quantized here), so the train-inference mismatch
is real.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Iterable

import torch
from torch import nn

from megatron_rl.rollout.base import RolloutEngine, Sample, SamplingParams, tensor_digest

ROLLOUT_QUANTS = ("bf16", "fp8_blockwise", "fp8_tensorwise", "nvfp4", "mxfp4")
FP4_QUANTS = ("nvfp4", "mxfp4")  # W4A4: weights arrive in high precision, quantized on arrival
SCALE_FORMATS = ("fp32", "ue8m0")
FP8_DTYPES = (torch.float8_e4m3fn,)
SCALE_LEAF = {"fp8_blockwise": "weight_scale_inv", "fp8_tensorwise": "weight_scale"}  # FP8 checkpoint names
# Held tensors a quantized linear rewrites on every weight load.
QUANTIZED_LEAVES = {"fp8_blockwise": ("weight", "weight_scale_inv"), "fp8_tensorwise": ("weight", "weight_scale"),
                    "nvfp4": ("weight", "weight_scale", "weight_amax"), "mxfp4": ("weight", "weight_scale")}


def _load_model(hf_model_or_dir: Any, dtype: torch.dtype, device: str) -> nn.Module:
    """A private, eval-mode copy: the engine never aliases the caller's (trainer's) tensors."""
    if isinstance(hf_model_or_dir, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(os.fspath(hf_model_or_dir), dtype=dtype, use_safetensors=True)
    elif isinstance(hf_model_or_dir, nn.Module):
        model = copy.deepcopy(hf_model_or_dir).to(dtype)
    else:
        raise ValueError(f"hf_model_or_dir must be an HF model or a folder, got {type(hf_model_or_dir).__name__}")
    return model.to(device).eval().requires_grad_(False)


def _filter(probs_BV: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Zero tokens outside top-k, outside the smallest set whose mass reaches top_p, and below
    min_p x the top probability, each judged on the untruncated probabilities, as SGLang's
    top_k_top_p_min_p_sampling_from_probs_torch (srt/layers/sampler.py) does. The top token stays."""
    sorted_p, order = probs_BV.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    drop = mass_before >= sampling.top_p
    if sampling.top_k > 0:
        drop |= torch.arange(sorted_p.shape[-1], device=sorted_p.device) >= sampling.top_k
    if sampling.min_p > 0.0:
        drop |= sorted_p < sorted_p[:, :1] * sampling.min_p
    drop[:, 0] = False
    return torch.zeros_like(probs_BV).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))


def sample_tokens(
    logits_BV: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits_BV: [B, V] float32 -> (tokens [B] int64, logprobs [B] float32).

    logprobs are log_softmax(logits / T) at the drawn tokens (T = 1 when greedy), before
    top-k / top-p / min-p.
    """
    if sampling.temperature == 0.0:
        tokens = logits_BV.argmax(dim=-1)
        return tokens, torch.log_softmax(logits_BV, dim=-1).gather(-1, tokens[:, None])[:, 0]
    logprobs_BV = torch.log_softmax(logits_BV / sampling.temperature, dim=-1)
    probs_BV = logprobs_BV.exp()
    if sampling.top_p < 1.0 or sampling.top_k > 0 or sampling.min_p > 0.0:
        probs_BV = _filter(probs_BV, sampling)
    tokens = torch.multinomial(probs_BV, 1, generator=generator)[:, 0]
    return tokens, logprobs_BV.gather(-1, tokens[:, None])[:, 0]


class TorchRolloutEngine(RolloutEngine):
    """In-process rollout engine over a transformers causal LM (see the module docstring).

    Args:
        hf_model_or_dir: a transformers causal LM (deep-copied) or a folder with safetensors weights.
        rollout_quant: "bf16" (no quantization; the model runs in `dtype`) | "fp8_blockwise" |
            "fp8_tensorwise" (W8A8 emulation of every linear outside `high_precision`) | "nvfp4" |
            "mxfp4" (W4A4 emulation, megatron_rl.fp8.w4a4).
        weight_block_size: (rows, cols) of a weight scale block, blockwise only.
        scale_format: "fp32" | "ue8m0" (power-of-two scales).
        high_precision: HF-name substrings of modules never quantized (lm_head always, when tied).
        device, dtype: where and in what high-precision dtype the model runs.
        seed: seeds the engine's generator, used by generate() calls whose SamplingParams.seed is None.
        max_batch_size: rows (prompts x n) per decode batch; None = all at once.
        tokenizer: decodes responses for SamplingParams.stop; None = loaded from the folder on first use.
    """

    def __init__(
        self,
        hf_model_or_dir: Any,
        *,
        rollout_quant: str = "bf16",
        weight_block_size: tuple[int, int] = (128, 128),
        scale_format: str = "fp32",
        high_precision: tuple[str, ...] = ("embed_tokens", "lm_head", "norm"),
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        max_batch_size: int | None = None,
        tokenizer: Any = None,
        kv_cache_dtype: str = "auto",
    ):
        _check_choice("rollout_quant", rollout_quant, ROLLOUT_QUANTS)
        _check_choice("scale_format", scale_format, SCALE_FORMATS)
        if len(weight_block_size) != 2 or min(weight_block_size) < 1:
            raise ValueError(f"weight_block_size must be two positive ints, got {weight_block_size}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size}")
        self.rollout_quant = rollout_quant
        self.weight_block_size = tuple(int(b) for b in weight_block_size)
        self.scale_format = scale_format
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self._tokenizer = tokenizer
        # The folder the stop-string tokenizer loads from on first use when none was passed.
        self.stop_tokenizer_source = hf_model_or_dir if isinstance(hf_model_or_dir, (str, os.PathLike)) else None
        self.model = _load_model(hf_model_or_dir, dtype, device)
        self.config = self.model.config
        self.high_precision = self._high_precision(tuple(high_precision))
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._quantized: dict[str, nn.Module] = self._quantize_linears() if rollout_quant != "bf16" else {}
        self._held = self._held_tensors()
        self._own_storage()
        self._version = 0
        self._pending_version: int | None = None  # an update is in progress
        self._pending_fp8: dict[str, dict[str, torch.Tensor]] = {}  # module -> halves of an FP8 pair
        self._updated: set[str] = set()  # held names written during the update in progress
        self._paused = self._released = self._needs_full_update = self._shut_down = False
        self._kv_released = False  # generate() allocates its cache; released = not allowed to
        self._released_shapes: dict[str, tuple[torch.Size, tuple[int, ...]]] = {}
        _check_choice("kv_cache_dtype", kv_cache_dtype, ("auto", "fp8_e4m3"))
        # fp8_e4m3: SGLang's FP8 KV cache emulated (rollout/fp8_kv_cache.py), unit scales until synced.
        self.kv_scales = ([[1.0, 1.0] for _ in range(self.config.num_hidden_layers)]
                          if kv_cache_dtype == "fp8_e4m3" else None)

    # ---- construction helpers ------------------------------------------------------------

    def _high_precision(self, patterns: tuple[str, ...]) -> tuple[str, ...]:
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        if tied:
            out_w, in_w = self.model.get_output_embeddings().weight, self.model.get_input_embeddings().weight
            assert out_w is in_w, "tie_word_embeddings is set but lm_head and embed_tokens are not one tensor"
            # Quantizing a tied lm_head would untie it from the embedding the next update writes.
            patterns = tuple(dict.fromkeys(patterns + ("lm_head",)))
        return patterns

    def _quantize_linears(self) -> dict[str, nn.Module]:
        """Swap quantizable nn.Linear modules for W8A8 / W4A4 ones; {HF module name: module}."""
        from megatron_rl.fp8 import w4a4, w8a8

        patterns = self.high_precision

        def skip(name: str, module: nn.Module) -> bool:  # the contract's list plus routers (default_skip)
            return w8a8.default_skip(name, module) or any(p in name for p in patterns)

        if self.rollout_quant in FP4_QUANTS:
            w4a4.quantize_model_w4a4(self.model, self.rollout_quant, skip=skip)
            return {n: m for n, m in self.model.named_modules() if isinstance(m, w4a4.W4A4Linear)}
        w8a8.quantize_model_w8a8(
            self.model, self.weight_block_size, self.scale_format, skip=skip,
            mode=self.rollout_quant.removeprefix("fp8_"),
        )
        return {n: m for n, m in self.model.named_modules() if isinstance(m, w8a8.W8A8Linear)}

    def _own_storage(self) -> None:
        """Move every held tensor into storage of our own allocator. from_pretrained may leave
        tensors in safetensors' mmap at arbitrary alignment, and CPU GEMMs pick different kernels
        (and summation orders) for differently aligned operands: an engine re-allocated by
        resume_memory() would then differ in the last bits from a fresh one, and a resumed run
        would not repeat an uninterrupted one."""
        for t in self._unique_held():
            fresh = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            t.data = fresh.copy_(t.data)

    def _held_tensors(self) -> dict[str, torch.Tensor]:
        """{HF name: tensor} of every persistent tensor the model holds (tied names share one)."""
        return dict(self.model.state_dict(keep_vars=True))

    # ---- state guards --------------------------------------------------------------------

    def _require_serving(self) -> None:
        self._require_alive()
        if self._paused:
            raise RuntimeError("generate() on a paused engine; call resume() first")
        if self._released:
            raise RuntimeError("generate() after release_memory(); call resume_memory() and push weights")
        if self._kv_released:
            raise RuntimeError("generate() with the KV cache released; call resume_memory(('kv_cache',))")
        if self._pending_version is not None:
            raise RuntimeError(
                f"generate() while the update to version {self._pending_version} is incomplete; "
                "call finish_update() after the last bucket"
            )
        if self._needs_full_update:
            raise RuntimeError("weights were discarded by release_memory(); push a full update first")

    def _require_alive(self) -> None:
        if self._shut_down:
            raise RuntimeError("the engine was shut down")

    # ---- generation ----------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        """n samples per prompt, contiguous by prompt; see the module docstring for conventions.

        Args:
            prompts: token ids per prompt (non-empty, each id < vocab_size).
        Returns:
            len(prompts) * n Samples; sample k belongs to prompt k // n.
        """
        self._require_serving()
        self._check_prompts(prompts)
        generator = self._generator
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        rows = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(sampling.n)]
        step = self.max_batch_size or max(len(rows), 1)
        samples: list[Sample] = []
        for start in range(0, len(rows), step):
            samples.extend(self._generate_rows(rows[start : start + step], sampling, generator))
        return samples

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        vocab = self.config.vocab_size
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")

    def _stop_ids(self, sampling: SamplingParams) -> torch.Tensor:
        stop = set(sampling.stop_token_ids)
        eos = getattr(self.config, "eos_token_id", None)
        if not sampling.ignore_eos and eos is not None:
            stop.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return torch.tensor(sorted(stop), dtype=torch.long, device=self.device)

    @torch.no_grad()
    def _generate_rows(
        self, rows: list[tuple[int, list[int]]], sampling: SamplingParams, generator: torch.Generator
    ) -> list[Sample]:
        from transformers import DynamicCache

        ids, mask = self._left_pad([prompt for _, prompt in rows])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        if self.kv_scales is None:
            cache = DynamicCache(config=self.config)
        else:
            from megatron_rl.rollout.fp8_kv_cache import Fp8KvCache
            cache = Fp8KvCache([list(s) for s in self.kv_scales], config=self.config)
        stop_ids = self._stop_ids(sampling)
        done = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
        lengths = torch.full((len(rows),), sampling.max_new_tokens, dtype=torch.long, device=self.device)
        tokens_T, logprobs_T = [], []
        for step in range(sampling.max_new_tokens):
            logits = self._forward(ids, mask, positions, cache, step)
            tokens, logprobs = sample_tokens(logits, sampling, generator)
            tokens_T.append(tokens)
            logprobs_T.append(logprobs)
            stopped = ~done & torch.isin(tokens, stop_ids)
            if sampling.stop:
                stopped |= ~done & self._stop_string_hit(tokens_T, sampling.stop)
            lengths[stopped] = step + 1
            done |= stopped
            if bool(done.all()):
                break
            ids, mask = tokens[:, None], torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
            positions = positions[:, -1:] + 1
        return self._to_samples(rows, torch.stack(tokens_T, 1), torch.stack(logprobs_T, 1), lengths, done)

    def _stop_string_hit(self, tokens_T: list[torch.Tensor], stop: tuple[str, ...] | list[str]) -> torch.Tensor:
        """[B] bool: the decoded tail of each row contains a stop string. The tail is the last
        (longest stop string in tokens + 1) tokens, as SGLang's Req.tail_str (schedule_batch.py)."""
        tokenizer = self._stop_tokenizer()
        width = max(len(tokenizer.encode(s, add_special_tokens=False)) for s in stop) + 1
        tails = torch.stack(tokens_T[-width:], 1).tolist()
        texts = tokenizer.batch_decode(tails, skip_special_tokens=False)
        return torch.tensor([any(s and s in t for s in stop) for t in texts], device=self.device)

    def _stop_tokenizer(self):
        if self._tokenizer is None:
            if self.stop_tokenizer_source is None:
                raise ValueError("SamplingParams.stop needs a tokenizer: pass tokenizer= to TorchRolloutEngine")
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(os.fspath(self.stop_tokenizer_source))
        return self._tokenizer

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, L] int64 and mask [B, L] int64 (0 on padding); the pad id is never attended."""
        pad_id = getattr(self.config, "pad_token_id", None) or 0
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any, step: int):
        """Last-position logits [B, V] float32; a non-finite value is an error, never a sample."""
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1
        )
        logits = out.logits[:, -1].float()
        bad = ~torch.isfinite(logits).all(dim=-1)
        if bool(bad.any()):
            raise FloatingPointError(
                f"non-finite logits at decode step {step} in rows {bad.nonzero()[:, 0].tolist()[:8]} "
                f"(weight version {self._version})"
            )
        return logits

    @staticmethod
    def _to_samples(rows, tokens_BT, logprobs_BT, lengths, done) -> list[Sample]:
        tokens, logprobs, lengths, done = tokens_BT.tolist(), logprobs_BT.tolist(), lengths.tolist(), done.tolist()
        return [
            Sample(index, prompt, tokens[r][: lengths[r]], logprobs[r][: lengths[r]], "stop" if done[r] else "length")
            for r, (index, prompt) in enumerate(rows)
        ]

    # ---- weight updates ------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load one bucket of version `version` (see RolloutEngine for the protocol).

        Accepted per name: any held high-precision tensor (embeddings, norms, biases, lm_head and,
        in bf16 mode, linear weights); for a quantized linear X either a high-precision `X.weight`
        (quantized here) or the FP8 pair `X.weight` float8_e4m3fn + `X.weight_scale_inv`
        (blockwise; `X.weight_scale` tensorwise), possibly split across buckets. Unknown names,
        wrong shapes and FP8 tensors for a high-precision module raise ValueError naming the tensor.
        Writing `model.embed_tokens.weight` of a tied model also updates lm_head (one tensor).
        """
        self._require_alive()
        if self._released:
            raise RuntimeError("update_weights() after release_memory(); call resume_memory() first")
        self._begin_version(version)
        for name, tensor in named_tensors:
            self._load_one(name, tensor)

    def _begin_version(self, version: int) -> None:
        if self._pending_version is None:
            if version < self._version:
                raise ValueError(f"weight version {version} is older than the engine's {self._version}")
            self._pending_version = version
            self._updated = set()
        elif version != self._pending_version:
            raise ValueError(f"bucket of version {version} while version {self._pending_version} is in progress")

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        if self.kv_scales is not None and self._load_kv_scale(name, tensor):
            return
        module_name, _, leaf = name.rpartition(".")
        is_fp8_part = tensor.dtype in FP8_DTYPES or leaf in ("weight_scale_inv", "weight_scale")
        if is_fp8_part and self.rollout_quant in FP4_QUANTS:
            raise ValueError(f"tensor {name!r} ({tensor.dtype}): rollout_quant={self.rollout_quant!r} takes "
                             "high-precision linear weights and quantizes them itself; send X.weight only")
        if module_name in self._quantized and is_fp8_part:
            self._stage_fp8(module_name, leaf, tensor)
        elif module_name in self._quantized and leaf == "weight":
            module = self._quantized[module_name]
            self._check_shape(name, tensor, module.weight.shape)
            module.load_bf16(tensor.to(self.device, torch.float32))
            self._mark_quantized_updated(module_name)
        elif is_fp8_part:
            raise ValueError(
                f"tensor {name!r}: FP8 payload for a module the engine keeps in high precision "
                f"(rollout_quant={self.rollout_quant!r}, high_precision={self.high_precision})"
            )
        else:
            self._load_high_precision(name, tensor)

    def _load_kv_scale(self, name: str, tensor: torch.Tensor) -> bool:
        from megatron_rl.rollout.fp8_kv_cache import layer_of

        where = layer_of(name)
        if where is None:
            return False
        self.kv_scales[where[0]][where[1]] = float(tensor)
        return True

    def _stage_fp8(self, module_name: str, leaf: str, tensor: torch.Tensor) -> None:
        """Hold one half of an FP8 pair until the other arrives (a pair may span buckets)."""
        scale_leaf = SCALE_LEAF[self.rollout_quant]
        if leaf == "weight" and tensor.dtype in FP8_DTYPES:
            part = "weight"
        elif leaf == scale_leaf and tensor.dtype == torch.float32:
            part = "scale"
        else:
            raise ValueError(
                f"tensor {module_name}.{leaf} ({tensor.dtype}): rollout_quant={self.rollout_quant!r} takes "
                f"{module_name}.weight as float8_e4m3fn plus float32 {module_name}.{scale_leaf}"
            )
        self._pending_fp8.setdefault(module_name, {})[part] = tensor
        self._load_fp8_pair(module_name)

    def _load_high_precision(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._held:
            raise ValueError(f"unknown tensor {name!r}: the engine's model has no such weight")
        target = self._held[name]
        self._check_shape(name, tensor, target.shape)
        if not tensor.is_floating_point():
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}; expected a floating type")
        target.data.copy_(tensor)
        self._updated.update(n for n, t in self._held.items() if t is target)  # tied names too

    def _load_fp8_pair(self, module_name: str) -> None:
        halves = self._pending_fp8[module_name]
        if len(halves) < 2:
            return
        module = self._quantized[module_name]
        scale_name = f"{module_name}.{SCALE_LEAF[self.rollout_quant]}"
        self._check_shape(f"{module_name}.weight", halves["weight"], module.weight.shape)
        self._check_shape(scale_name, halves["scale"], self._held[scale_name].shape)
        module.load_fp8(halves["weight"].to(self.device), halves["scale"].to(self.device))
        del self._pending_fp8[module_name]
        self._mark_quantized_updated(module_name)

    def _mark_quantized_updated(self, module_name: str) -> None:
        self._updated.update(f"{module_name}.{leaf}" for leaf in QUANTIZED_LEAVES[self.rollout_quant])

    @staticmethod
    def _check_shape(name: str, tensor: torch.Tensor, shape: torch.Size) -> None:
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(shape)}")

    def finish_update(self, version: int) -> None:
        """Adopt `version` once every bucket is in.

        ValueError (the update stays incomplete and generate() keeps refusing) when an FP8 weight
        arrived without its scale or vice versa, or, after release_memory(), when a held tensor
        was not re-sent. Cache flush: KV caches live only inside one generate() call and a W8A8
        module drops its cached dequantized weight in load_fp8/load_bf16, so nothing stale survives.
        """
        self._require_alive()
        self._begin_version(version)
        if self._pending_fp8:
            missing = {m: sorted({"weight", "scale"} - set(h)) for m, h in self._pending_fp8.items()}
            raise ValueError(f"version {version}: incomplete FP8 pairs (module: missing part) {missing}")
        if self._needs_full_update:
            missing = sorted(set(self._held) - self._updated)
            if missing:
                raise ValueError(f"version {version}: weights discarded by release_memory() not re-sent: {missing[:8]}")
        self._version, self._pending_version, self._needs_full_update = version, None, False

    # ---- lifecycle -----------------------------------------------------------------------

    def pause(self) -> None:
        self._require_alive()
        self._paused = True

    def resume(self) -> None:
        self._require_alive()
        self._paused = False

    def release_memory(self, tags: tuple[str, ...] | None = None) -> None:
        """"weights": drop every held tensor's storage and the W8A8 dequantized copies (rotary
        tables and other derived buffers stay); "kv_cache": refuse generate() until resumed."""
        self._require_alive()
        tags = _check_tags(tags)
        self._kv_released |= "kv_cache" in tags
        if self._released or "weights" not in tags:
            return
        # Strides too: a re-allocated transposed weight must stay transposed, or the GEMMs change
        # their summation order and the rollout log-probs move in the last bits.
        self._released_shapes = {name: (t.shape, t.stride()) for name, t in self._held.items()}
        for t in self._unique_held():
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        for module in self._quantized.values():
            module.clear_cache()  # W8A8Linear's cached dequantized weight: free it with the storage
        self._released = True

    def resume_memory(self, tags: tuple[str, ...] | None = None) -> None:
        """"weights": allocate (uninitialized) storage again, generate() refusing until a full
        update lands; "kv_cache": serve generate() again."""
        self._require_alive()
        tags = _check_tags(tags)
        self._kv_released &= "kv_cache" not in tags
        if not self._released or "weights" not in tags:
            return
        for name, t in self._held.items():
            shape, stride = self._released_shapes[name]
            if t.numel() != shape.numel():  # tied names: allocate once
                t.data = torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
        self._released, self._needs_full_update = False, True

    def _unique_held(self) -> list[torch.Tensor]:
        return list({id(t): t for t in self._held.values()}.values())

    def shutdown(self) -> None:
        if self._shut_down:
            return
        self._held, self._quantized, self._pending_fp8 = {}, {}, {}
        del self.model
        self._shut_down = True

    def checksum(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """{HF name: tensor_digest(held tensor)}; FP8 linears hold `X.weight` (FP8) and its scale."""
        self._require_alive()
        wanted = list(self._held) if names is None else list(names)
        scales = self._kv_scale_tensors()
        unknown = [n for n in wanted if n not in self._held and n not in scales]
        if unknown:
            raise ValueError(f"checksum of unknown tensor(s) {unknown[:8]}")
        return {n: tensor_digest(self._held[n] if n in self._held else scales[n]) for n in wanted}

    def _kv_scale_tensors(self) -> dict[str, torch.Tensor]:
        """The emulated FP8 KV cache's scales as the sync sent them (float32 scalars)."""
        from megatron_rl.rollout.sglang_payload import kv_scale_tensors

        return dict(kv_scale_tensors(self.kv_scales)) if self.kv_scales is not None else {}


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{key}={value!r}; choose one of {choices}")


def _check_tags(tags: tuple[str, ...] | None) -> tuple[str, ...]:
    """SGLang's memory regions (constants.py GPU_MEMORY_TYPE_*); None = all. This engine captures
    no CUDA graphs: "cuda_graph" is accepted and holds nothing."""
    tags = MEMORY_TAGS if tags is None else tuple(tags)
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"memory tags {bad} are not among {list(MEMORY_TAGS)}")
    return tags


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
