"""The HuggingFace adapter: how the C++ loop reaches a transformers 5.x causal LM.

One call per decode step: token inputs are embedded with the model's own input embeddings,
embedding-only inputs (mask tokens) are appended, and the model runs on ``inputs_embeds`` with
explicit ``position_ids`` and a 4D additive float mask (0 / finfo(dtype).min; a boolean mask is
silently wrong on the eager path), writing into a ``TreeKVCache`` that the adapter grows by
doubling when a block would not fit. Logits come back for every input, except the prompt's own
positions at prefill when the drafter does not read them (``prefill_logits_from``, zeros there).

Sliding-window layers (Gemma 2/3, Cohere 2, Qwen 2/3 with ``use_sliding_window``, Mistral-style
models) get the window applied to the tree mask: a key at position k is visible to a query at
position p only if ``p - k < sliding_window`` (transformers' ``sliding_window_overlay``), on top of
the tree. Models whose config lists ``layer_types`` take ``{"full_attention": m, "sliding_attention":
m_sw}``; Mistral-style models (one window, every layer) take ``m_sw`` alone.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from transformers import GenerationMixin, PreTrainedModel

from mtprobe.cpu.linear_routes import STOCK, LinearRoutes, Router
from mtprobe.target_model.cache import TreeKVCache
from mtprobe.target_model.mask_hooks import (
    MaskLoRAFactors,
    checked_mask_temperature,
    decoder_layers,
    mask_input_hooks,
    mask_row_temperature,
    prepared_layer_offsets,
    prepared_mask_lora,
    scale_mask_logits,
)
from mtprobe.target_model.native_forward import allocate, forward_block
from mtprobe.target_model.plan import ForwardPlan, chain_mask
from mtprobe.target_model.sliding import sliding_mask, sliding_window
from mtprobe.tree_attention import NAME as TREE_ATTENTION

logger = logging.getLogger("mtprobe")


def check_causal_lm(model: object) -> None:
    """Raise a clear error unless ``model`` is a decoder-only HF model that can generate: a TypeError
    for another kind of model (not a PreTrainedModel, encoder-decoder, bidirectional, no LM head), a
    ValueError for a model whose weights are on the meta device (never loaded)."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"mtprobe needs a transformers PreTrainedModel causal LM (e.g. AutoModelForCausalLM), "
            f"got {type(model).__name__}"
        )
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise TypeError(f"{name} is an encoder-decoder model; mtprobe decodes decoder-only causal LMs")
    bidirectional = _bidirectional_attention(model)
    if bidirectional is not None:
        raise TypeError(
            f"{name} attends bidirectionally ({bidirectional}), so it is not a causal LM: its logits at a "
            "position depend on the tokens after it, and decoding with it is not next-token prediction. mtprobe "
            "needs a decoder-only causal LM (AutoModelForCausalLM; for BERT-like models, a *ForCausalLM / "
            "*LMHeadModel class with config.is_decoder=True)"
        )
    if not isinstance(model, GenerationMixin) or model.get_output_embeddings() is None:
        raise TypeError(
            f"{name} has no language-modelling head; load the model with "
            "AutoModelForCausalLM so it returns next-token logits"
        )
    meta = _first_meta_tensor(model)
    if meta is not None:
        raise ValueError(
            f"{name} has tensors on the meta device (the first: {meta!r}): they have shapes but no values, so "
            "the model cannot run. It was built with device='meta' (or init_empty_weights) and its weights were "
            "never loaded; load them (from_pretrained, or to_empty(device=...) and load_state_dict) first"
        )


def _first_meta_tensor(model: PreTrainedModel) -> str | None:
    """The name of the first parameter (else buffer) on the meta device, in ``named_parameters`` (else
    ``named_buffers``) order, or None. Tensors of modules that accelerate offloads (a module or an
    ancestor with an ``_hf_hook``) are meta on purpose, loaded by the hook at every forward, and are
    not counted.

    One walk of the module tree, in ``named_modules`` order with its de-duplication (a shared module
    or tensor counts under its first name only), reading each module's own tensors: a generate call
    runs this check, and three walks through ``named_*`` cost more than its decoding on a small model.
    """
    seen_modules: set[int] = set()
    seen_tensors: set[int] = set()
    first_buffer: str | None = None
    # [(module, its name, whether it or an ancestor has an _hf_hook)], popped in pre-order.
    stack: list[tuple[torch.nn.Module, str, bool]] = [(model, "", False)]
    while stack:
        module, name, hooked = stack.pop()
        if id(module) in seen_modules:
            continue
        seen_modules.add(id(module))
        # accelerate sets the hook as a plain attribute; hasattr would go through Module.__getattr__
        # and an AttributeError for every module without one.
        hooked = hooked or "_hf_hook" in module.__dict__
        prefix = name + "." if name else ""
        for key, tensor in module._parameters.items():
            if tensor is not None and id(tensor) not in seen_tensors:
                seen_tensors.add(id(tensor))
                if tensor.is_meta and not hooked:
                    return prefix + key
        for key, tensor in module._buffers.items():
            if tensor is not None and id(tensor) not in seen_tensors:
                seen_tensors.add(id(tensor))
                if tensor.is_meta and not hooked and first_buffer is None:
                    first_buffer = prefix + key
        children = module._modules
        if children:
            stack.extend(
                (child, prefix + key, hooked)
                for key, child in reversed(children.items())
                if child is not None
            )
    return first_buffer


def _bidirectional_attention(model: PreTrainedModel) -> str | None:
    """Why ``model`` attends bidirectionally (the config setting that says so), or None for a causal model.

    transformers marks it three ways: ``config.is_causal = False`` (e.g. Gemma 4 with
    ``use_bidirectional_attention="all"``), ``use_bidirectional_attention`` (Gemma-family encoders such
    as EmbeddingGemma), and ``is_decoder=False`` in the BERT family (BertForMaskedLM, or BertLMHeadModel,
    RobertaForCausalLM, ... without ``is_decoder=True``). GPT-NeoX also carries ``is_decoder=False`` but its
    attention is always causal (its attention modules say ``is_causal = True``), so for ``is_decoder``
    the attention modules decide.
    """
    cfg = model.config.get_text_config(decoder=True)
    if getattr(cfg, "is_causal", None) is False:
        return "config.is_causal=False"
    both = getattr(cfg, "use_bidirectional_attention", None)
    if both is True or both == "all":
        return f"config.use_bidirectional_attention={both!r}"
    if getattr(cfg, "is_decoder", None) is False and not any(
        getattr(m, "is_causal", None) is True for m in model.modules()
    ):
        return "config.is_decoder=False"
    return None


def cache_argument(module: torch.nn.Module) -> str:
    """The name ``module.forward`` takes its KV cache under: ``cache`` in the transformers releases that
    renamed it (5.2x, which warn that ``past_key_values`` goes in 5.40), ``past_key_values`` before."""
    return "cache" if "cache" in forward_parameters(module) else "past_key_values"


def forward_parameters(module: torch.nn.Module) -> tuple[str, ...]:
    """The names of the parameters ``module.forward`` takes, as ``inspect.signature`` gives them."""
    forward = module.forward
    if not (inspect.ismethod(forward) and inspect.isfunction(forward.__func__)):
        return tuple(inspect.signature(forward).parameters)  # an instance's own forward (accelerate's)
    # The class's forward has one signature for every instance (and it costs ~0.1 ms to build); held
    # weakly, so that a class defined at run time can go.
    names = _METHOD_PARAMETERS.get(forward.__func__)
    if names is None:
        names = _METHOD_PARAMETERS[forward.__func__] = tuple(inspect.signature(forward).parameters)
    return names


# function -> the parameters of its bound method, for forward_parameters.
_METHOD_PARAMETERS: weakref.WeakKeyDictionary[Callable[..., Any], tuple[str, ...]] = (
    weakref.WeakKeyDictionary()
)


def max_positions(model: PreTrainedModel) -> int:
    """The model's context limit in positions (absolute-position models fail beyond it)."""
    cfg = model.config.get_text_config(decoder=True)
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2**31 - 1


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or (a is not None and b is not None and a.shape == b.shape and torch.equal(a, b))


class SharedPrefill:
    """One prefill for the sequences of one prompt (``num_return_sequences``), as HF's generate runs one
    batched prefill for them: the first adapter to run it keeps what it produced (logits, hidden states and
    every layer's KV entries); an adapter given the same inputs and settings later takes copies of them
    instead of running the model again. Exact: the model and its weights are the same for every sequence
    of a call and run in eval mode, so a second prefill would compute the same numbers. Not used with a
    forward plan (its one KV buffer is the plan's, shared by the sequences in turn).
    """

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._inputs: tuple[torch.Tensor | None, ...] = ()
        self._logits: torch.Tensor | None = None  # [T, vocab]
        self._hidden: torch.Tensor | None = None  # [T, hidden]
        self._entries: TreeKVCache | None = None  # the prefill's T entries of every layer
        self.taken = 0  # prefills served from the kept one

    @staticmethod
    def _settings(adapter: HFAdapter, want_hidden: bool) -> tuple[Any, ...]:
        # What else shapes a prefill's outputs: identity, since one call computes them once for all.
        return (
            want_hidden,
            adapter.hidden_layer,
            adapter.prefill_logits_from,
            id(adapter._mask_offsets),
            id(adapter._mask_lora),
            id(adapter._mask_temperature),
        )

    def keep(
        self,
        adapter: HFAdapter,
        inputs: tuple[torch.Tensor | None, ...],
        want_hidden: bool,
        logits: torch.Tensor,  # [T, vocab]
        hidden: torch.Tensor | None,  # [T, hidden]
    ) -> None:
        """Keep the prefill ``adapter`` has just run (the first one of the call)."""
        if self._key is not None:
            return
        if not all(layer.is_initialized for layer in adapter.cache.layers):
            return  # a layer the model never wrote: nothing sound to share
        T = inputs[2].shape[-1]  # position_ids [1, T]
        self._entries = TreeKVCache(len(adapter.cache.layers), T)
        self._entries.copy_entries(adapter.cache, 0, T)
        self._key = self._settings(adapter, want_hidden)
        # Copies: the caller may reuse its input buffers for the next forward.
        self._inputs = tuple(t.clone() if t is not None else None for t in inputs)
        self._logits = logits.clone()
        self._hidden = hidden.clone() if hidden is not None else None

    def take(
        self, adapter: HFAdapter, inputs: tuple[torch.Tensor | None, ...], want_hidden: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Copies of the kept prefill's logits and hidden states, with its KV entries written into
        ``adapter``'s cache, when ``inputs`` and the settings are the kept prefill's; else None."""
        if self._key is None or self._key != self._settings(adapter, want_hidden):
            return None
        if not all(_same(a, b) for a, b in zip(inputs, self._inputs, strict=True)):
            return None
        T = inputs[2].shape[-1]
        adapter.reserve(T)  # the adapter's growth policy; copy_entries then finds the room
        assert self._entries is not None and self._logits is not None
        adapter.cache.copy_entries(self._entries, 0, T)
        self.taken += 1
        return self._logits.clone(), (self._hidden.clone() if self._hidden is not None else None)


class HFAdapter:
    """Runs one draft block through ``model``; owns the model's KV cache for one sequence.

    ``capacity`` is the cache's first size in entries; it doubles whenever a block would not fit,
    never past ``max_capacity`` (the most one generation can need) unless a block needs more.
    ``checked``: the caller has just run ``check_causal_lm`` on ``model``, so it is not run again.
    ``linear_routes``: the route of each decode step's linear layers by its block size
    (:func:`mtprobe.target_model.profile.choose_linear_routes`); None runs torch's linear everywhere.
    ``plan``: run every forward through a static forward plan (:mod:`mtprobe.target_model.plan`: one fixed KV
    buffer, buckets, CUDA graphs on a GPU); it owns the cache, and ``capacity`` is then unused.
    ``shared_prefill``: the prefill of the other sequences of the same prompt, run once
    (:class:`SharedPrefill`; unused with a plan). ``native``: the model's C++ forward
    (:func:`mtprobe.target_model.native_forward.native_forward`; unused with a plan; :attr:`runs_native`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        capacity: int,
        max_capacity: int | None = None,
        *,
        checked: bool = False,
        linear_routes: LinearRoutes | None = None,
        plan: ForwardPlan | None = None,
        shared_prefill: SharedPrefill | None = None,
        native: Any = None,
    ) -> None:
        if not checked:
            check_causal_lm(model)
        self.model = model
        self.embed = model.get_input_embeddings()
        num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        if plan is not None:
            plan.check(model)
        self.plan = plan
        self.cache: TreeKVCache | Any = TreeKVCache(num_layers, capacity) if plan is None else plan.cache
        self.shared_prefill = shared_prefill if plan is None else None
        self.prefill_shared = False  # whether this sequence's prefill was taken from shared_prefill
        # Whether the prompt's entries are in the cache: set by the prefill, read between forwards (a draft
        # that takes the target's entries, drafters.draft_model_drafter). A tensor, so that a batched forward
        # (mtprobe._C.BatchedForward), which runs the prefill without this adapter, sets it too.
        self.prefilled_flag = torch.zeros((), dtype=torch.bool)
        # A batch decoded together (mtprobe.decode.batch) sets these, the last three before the drafter is made:
        # the row (mtprobe._C.BatchedForward, index) its self-draft's steps meet at (None: alone), how many
        # sequences share its forwards (a scheduler prices a step as the batch's forward), the batch step's
        # measured overhead (SharedSeconds) and whether the batch lets its rows draft (BatchDrafting).
        self.batch_row: tuple[Any, int] | None = None
        self.batch_rows = 1
        self.batch_overhead: Any = None
        self.batch_drafting: Any = None
        self._cache_arg = cache_argument(model)
        self.max_capacity = max_capacity
        self.sliding = sliding_window(model)
        self._tree_attention = getattr(model.config, "_attn_implementation", None) == TREE_ATTENTION
        # The prefill's first input whose logits anyone reads: 0 keeps all; the owner sets it to the last prompt
        # token when its drafter does not read the prompt's own distributions (only STAND's and the hybrid's stores
        # do): the LM head over a long prompt is a large share of the prefill, and HF's generate skips it too.
        self.prefill_logits_from = 0
        self._logits_to_keep = "logits_to_keep" in forward_parameters(model)
        # Which of the model's hidden_states a drafter reads: -1, the last (final-normed); a circuit
        # head with LoRA draft layers reads the input of the first of them (mtprobe.heads.lora).
        self.hidden_layer = -1
        # What calibrated masks change at the mask inputs (mtprobe.target_model.mask_hooks), None for nothing:
        # [k, num_layers, hidden] added before each decoder layer (set_mask_layer_offsets); [k] the masks' logits
        # are divided by, mask j's by temperature[j - 1] (set_mask_temperature), and [>= mask inputs of a forward]
        # that per mask input, built once, grown as needed; the mask LoRA's factors in the model's dtype.
        self._mask_offsets: torch.Tensor | None = None
        self._mask_temperature: torch.Tensor | None = None
        self._mask_rows: torch.Tensor | None = None
        self._mask_lora: MaskLoRAFactors | None = None
        self._layers: torch.nn.ModuleList | None = None
        # How a decode step's linear layers run, by its block size (mtprobe.cpu.linear_routes); the prefill torch's.
        self.linear_routes = linear_routes
        self.native = native if plan is None else None  # the C++ forward for decode blocks, None for HF's
        self._router_kept: tuple[Router | None] | None = None  # built at its first use (_router)

    @property
    def _router(self) -> Router | None:
        """The router of this adapter's linear routes (None where every block size takes torch's linear), built at
        its first routed forward through HF's modules: with the C++ forward only a near-tie's routes, and building
        it walks every linear layer (most generations never need it)."""
        if self._router_kept is None:
            used = self.linear_routes.used if self.linear_routes is not None else frozenset()
            self._router_kept = (Router(self.model, used) if used - {STOCK} else None,)
        return self._router_kept[0]

    def set_mask_layer_offsets(self, offsets: torch.Tensor | None) -> None:
        """Add ``offsets[l]`` (``[num_layers, hidden]``; ``[k, num_layers, hidden]``: one set per mask,
        :func:`.mask_hooks.layer_offsets`) to every mask input before decoder layer l from now on (None:
        nothing); ValueError, before any forward, if the model's layers cannot be found or differ in number."""
        if offsets is not None:
            self._layers = decoder_layers(self.model)
            offsets = prepared_layer_offsets(offsets, self._layers, self.embed.weight)
        self._mask_offsets = offsets

    def set_mask_lora(self, lora: dict[str, torch.Tensor] | None) -> None:
        """Adapt the model's projections at every mask input from now on (:func:`.mask_hooks.mask_lora`;
        None: nothing); ValueError, before any forward, if the entries do not fit the model's layers."""
        factors = None
        if lora is not None:
            self._layers = decoder_layers(self.model)
            factors = prepared_mask_lora(lora, self._layers, self.embed.weight)
        self._mask_lora = factors

    def set_mask_temperature(self, temperature: torch.Tensor | None) -> None:
        """Divide the logits of mask j by ``temperature[j - 1]`` (``[k]``, :func:`.mask_hooks.scale_mask_logits`)
        from now on (None: nothing); ValueError, before any forward, unless every entry is finite and > 0."""
        if temperature is not None:
            temperature = checked_mask_temperature(temperature).to(self.embed.weight.device)
        self._mask_temperature = temperature
        self._mask_rows = None

    def _mask_row_temperature(self, temperature: torch.Tensor, n: int) -> torch.Tensor:
        """``[>= n]`` the temperature of each mask input of a forward with n of them, ``temperature``
        (``[k]``, the one set) repeated; cached, so a step costs a view."""
        rows = self._mask_rows
        if rows is None or rows.shape[0] < n:
            rows = self._mask_rows = mask_row_temperature(temperature, max(n, 64))
        return rows

    def reserve(self, needed: int) -> None:
        """Room for ``needed`` entries: double the cache (amortised O(1) copy per token)."""
        if self.plan is not None:
            self.plan.reserve(needed)
            return
        capacity = self.cache.capacity
        if needed <= capacity:
            return
        grown = max(needed, 2 * capacity)
        if self.max_capacity is not None:
            grown = max(needed, min(grown, self.max_capacity))
        self.cache.reserve(grown)

    def forward(
        self,
        tokens: torch.Tensor,  # [n_tok] int64
        embeds: torch.Tensor | None,  # [n_emb, hidden]
        position_ids: torch.Tensor,  # [1, T]
        mask: torch.Tensor | None,  # [1, 1, T, P + T] additive, None for a causal chain
        prefix_len: int,
        want_hidden: bool,
        *,
        native: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's logits ``[T, vocab]`` (and hidden states ``[T, hidden]`` with ``want_hidden``), its KV
        entries written after the first ``prefix_len``: the decode loop's forward. ``native=False``: through
        HF's modules even where the C++ forward runs decode blocks (:attr:`exact_forward`)."""
        shared = None
        if prefix_len == 0:
            self.prefilled = True  # once this forward returns
            # An exact re-run decides a near-tie of the C++ prefill: it neither takes that prefill nor keeps its own.
            shared = self.shared_prefill if native or not self.runs_native else None
        if shared is not None:
            taken = shared.take(self, (tokens, embeds, position_ids, mask), want_hidden)
            if taken is not None:
                self.prefill_shared = True
                return taken
        self.reserve(prefix_len + position_ids.shape[-1])
        self.cache.set_length(prefix_len)
        if native and self.runs_native:
            logits_from = self.prefill_logits_from if prefix_len == 0 else 0
            args = (tokens, embeds, position_ids, mask, prefix_len, want_hidden, logits_from)
            done = forward_block(self.native, self.cache.layers, *args)
            logits, hidden = self._scaled(done, tokens, embeds)
            if shared is not None:
                shared.keep(self, (tokens, embeds, position_ids, mask), want_hidden, logits, hidden)
            return logits, hidden
        x = self.embed(tokens.unsqueeze(0))  # [1, n_tok, hidden]
        if embeds is not None:
            x = torch.cat([x, embeds.unsqueeze(0).to(x.dtype)], dim=1)  # [1, T, hidden]
        T = position_ids.shape[-1]
        skip = self.prefill_logits_from if prefix_len == 0 and self._logits_to_keep else 0
        hooks = None  # the calibrated masks' layer offsets and LoRA, at the mask inputs (mask_hooks)
        if self._layers is not None and embeds is not None:
            hooks = mask_input_hooks(self._layers, self._mask_offsets, self._mask_lora, tokens.shape[0])
        linears = contextlib.nullcontext()
        if prefix_len > 0 and self._router is not None:
            linears = self._router.routed(self.linear_routes.route(T))
        with hooks or contextlib.nullcontext(), linears:
            if self.plan is not None:
                # The hooks split each forward at its first mask input, a number a graph would freeze.
                eager = "calibrated masks with layer offsets or a mask LoRA (forward hooks)" if hooks else ""
                logits, hidden = self._planned_forward(
                    x, mask, position_ids, prefix_len, want_hidden, skip, eager
                )
            else:
                attn = self._attention_mask(mask, position_ids, prefix_len)
                out, hid = self._run_model(x, attn, position_ids, want_hidden, skip)
                logits, hidden = out[0], (hid[0] if hid is not None else None)  # [T, vocab], [T, hidden]
        logits, hidden = self._scaled((logits, hidden), tokens, embeds)
        if shared is not None:
            shared.keep(self, (tokens, embeds, position_ids, mask), want_hidden, logits, hidden)
        return logits, hidden

    @property
    def prefilled(self) -> bool:
        return bool(self.prefilled_flag)

    @prefilled.setter
    def prefilled(self, value: bool) -> None:
        self.prefilled_flag.fill_(value)

    def allocate_native_cache(self, capacity: int) -> None:
        """The cache allocated at ``capacity`` entries now, in the C++ forward's layout, so that its buffers
        stay where they are while a batched forward writes them (no growth mid-run)."""
        if self.native is None or self.plan is not None:
            raise RuntimeError(
                "allocate_native_cache: this adapter runs HF's forward (no C++ forward, or a plan)"
            )
        self.reserve(capacity)
        allocate(self.native, self.cache.layers)

    @property
    def runs_native(self) -> bool:
        """Whether the C++ forward runs this adapter's forwards (prefill and decode steps): not with calibrated
        masks' layer offsets or LoRA (hooks inside HF's layers), nor for a drafter that reads another layer's
        hidden states than the last."""
        plain = self._mask_offsets is None and self._mask_lora is None and self.hidden_layer == -1
        return self.native is not None and plain

    @property
    def decides_near_ties(self) -> bool:
        """Whether HF's forward should decide the C++ forward's near-ties (DecodeOptions.margin_bound): for a
        float32 model, whose HF greedy tokens the C++ forward matches up to rounding. A bfloat16 model's C++
        forward computes in float32, nearer its float32 logits than HF's bfloat16 forward (which itself rounds
        a block differently from one token), so HF's would decide nothing exactly."""
        return self.runs_native and self.model.dtype == torch.float32

    exact_forward = functools.partialmethod(forward, native=False)
    """:meth:`forward` through HF's modules: the decode loop's exact forward, which decides near-ties
    (DecodeOptions.margin_bound)."""

    def _scaled(
        self, out: tuple[torch.Tensor, torch.Tensor | None], tokens: torch.Tensor, embeds: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The calibrated masks' temperatures applied to the mask inputs' logits rows (in place)."""
        temperature = self._mask_temperature
        if temperature is not None and embeds is not None:
            logits, start = out[0], tokens.shape[0]
            scale_mask_logits(logits, self._mask_row_temperature(temperature, logits.shape[0] - start), start)
        return out

    def _run_model(
        self,
        x: torch.Tensor,  # [1, T, hidden]
        attention_mask: Any,
        position_ids: torch.Tensor,  # [1, T]
        want_hidden: bool,
        skip: int,
        cache: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [B, T, vocab], [B, T, hidden]?
        """The model over ``x`` on ``cache`` (None: the adapter's; a batch's plan passes its own). ``skip``: the
        first rows whose logits nobody reads (the prefill's prompt) are not computed; they come back as zeros."""
        kwargs = {"logits_to_keep": x.shape[1] - skip} if skip > 0 else {}
        out = self.model(
            inputs_embeds=x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            output_hidden_states=want_hidden,
            **{self._cache_arg: self.cache if cache is None else cache},
            return_dict=True,
            **kwargs,
        )
        logits = out.logits  # [1, T - skip, vocab]
        if skip > 0:
            # One pass over the prompt's rows (zeros), not a second one to concatenate: on a long prompt
            # they are most of the tensor (700 rows of SmolLM2's vocabulary: 137 MB).
            full = logits.new_zeros((1, skip + logits.shape[1], logits.shape[-1]))  # [1, T, vocab]
            full[:, skip:] = logits
            logits = full
        return logits, (out.hidden_states[self.hidden_layer] if want_hidden else None)

    def _planned_forward(
        self,
        x: torch.Tensor,  # [1, T, hidden]
        mask: torch.Tensor | None,  # [1, 1, T, P + T] additive, None for a causal chain
        position_ids: torch.Tensor,  # [1, T]
        prefix_len: int,
        want_hidden: bool,
        skip: int,
        eager: str,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        plan = self.plan
        assert plan is not None
        T = position_ids.shape[-1]
        if (
            mask is None
            and prefix_len > 0
            and (plan.pad or plan.graphs)
            and plan.config.bucket(T) is not None
        ):
            # A padded or captured chain needs its causal mask spelled out.
            mask = chain_mask(prefix_len, T, x.dtype, x.device)
        attn = self._attention_mask(mask, position_ids, prefix_len)
        as_dict = isinstance(attn, dict)
        masks = attn if isinstance(attn, dict) else {"": attn}

        def run_model(
            xb: torch.Tensor, attention_mask: Any, pos: torch.Tensor, hidden: bool
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            return self._run_model(xb, attention_mask, pos, hidden, skip)

        # What run_model computes beyond its inputs, part of its graphs' key: which hidden states it returns.
        variant = (self.hidden_layer,)
        return plan.run(
            run_model,
            x,
            masks,
            position_ids,
            prefix_len,
            want_hidden,
            as_dict=as_dict,
            variant=variant,
            eager=eager,
        )

    def _attention_mask(
        self,
        mask: torch.Tensor | None,  # [1, 1, T, P + T] additive, None for a causal chain
        position_ids: torch.Tensor,  # [1, T]
        prefix_len: int,
    ) -> torch.Tensor | dict[str, torch.Tensor] | None:
        sw = self.sliding
        # Positions stay below prefix_len + T, so a block that ends inside the window needs no window.
        # A chain (mask None) gets its sliding mask from the model itself, as in plain generation.
        if sw is None or mask is None or prefix_len + position_ids.shape[-1] <= sw.window:
            return mask
        if self._tree_attention:
            if int(position_ids.max()) < sw.window:  # exact check (a sync) only on this refusal path
                return mask
            raise NotImplementedError(
                f"{type(self.model).__name__} has a sliding window of {sw.window} and the sequence outgrew it; "
                f"the {TREE_ATTENTION!r} attention takes the tree as ancestor bits and cannot apply a window. "
                "Load the model with attn_implementation='sdpa' or 'eager'"
            )
        masked = sliding_mask(mask, position_ids, prefix_len, sw.window)
        if sw.per_layer_type:
            return {"full_attention": mask, "sliding_attention": masked}
        return masked

    def kv_buffers(self) -> list[torch.Tensor]:
        return self.cache.buffers()
