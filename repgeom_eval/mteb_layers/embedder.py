"""Texts → one embedding per text at many layer addresses, from ONE forward pass per batch.

The data path is the project's own: ``load_model`` → ``resolve_request`` → ``Forward`` (hooks, early stop
after the deepest requested module) → mask-aware ``pool`` in float64 → optional unit normalisation. A
sentence-transformers folder contributes its own recipe (pooling mode, Normalize, ``max_seq_length``, lower-casing,
prompts) unless the caller overrides it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from repgeom_eval.output.progress import progress_bar as tqdm  # bars or log lines: --progress

from repgeom_eval.modeling.addresses import Address, HookPoint, resolve, resolve_request
from repgeom_eval.spec.layer_request import LayerRequest, layer_request
from repgeom_eval.spec.options.mteb import POOLINGS as POOLING_CHOICES  # the name mteb_layers exports
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.functional.dispersion import unit
from repgeom_eval.modeling.in_memory import as_loaded
from repgeom_eval.modeling.loading import LoadedModel, load_model
from repgeom_eval.measurement.forward import Batch, Forward, context_length, token_lengths
from repgeom_eval.measurement.plan import Item, plan_shard
from repgeom_eval.measurement.texts import Record
from repgeom_eval.plugin_system.host import PluginHost, get_host
from repgeom_eval.measurement.pooling import pool
from repgeom_eval.spec.poolings import check_pooling

from repgeom_eval.modeling.st_config import STConfig, st_config_for, st_config_of

#: ``--pooling`` choices: the repgeom poolings plus ``st`` (the model's own) and ``auto`` (``st`` if the model is a
#: sentence-transformers model, else ``mean`` as in paper B).
_SITE_OFFSET = {"resid_pre": 0.0, "attn_out": 0.25, "resid_mid": 0.5, "mlp_in": 0.5, "mlp_out": 0.75, "resid_post": 1.0}


@dataclass(frozen=True)
class Recipe:
    """How token vectors become the embedding mteb scores (part of every result's identity)."""

    pooling: str  # mean, last or first
    normalize: bool
    max_length: int
    lowercase: bool = False
    preprocess: str = "none"  # none, center, standardize or whiten (between pooling and normalisation)
    preprocess_stats: str | None = None  # where its statistics come from: "task", or "file-<sha256 prefix>"

    def experiment_kwargs(self, address: Address, max_length_is_default: bool) -> dict[str, object]:
        out: dict[str, object] = {"layer": str(address), "pooling": self.pooling, "normalize": self.normalize}
        if not max_length_is_default:
            out["max_length"] = self.max_length
        if self.preprocess != "none":  # absent otherwise: results written before the option keep their identity
            out["preprocess"] = self.preprocess
            out["preprocess_stats"] = self.preprocess_stats
        return out


class LayerEmbedder:
    """A loaded model plus its embedding recipe; :meth:`embed` returns the vectors of many addresses at once.

    Args:
        model: Hugging Face hub id, local model directory (a sentence-transformers folder works), ``.gguf`` file, an
            already loaded :class:`~repgeom_eval.modeling.loading.LoadedModel`, or a model in memory: a
            ``SentenceTransformer`` (its own pooling), a transformers model (with ``tokenizer``) or a PEFT model.
        pooling: ``auto`` (the model's sentence-transformers pooling if it has one, else ``mean``), ``st``, ``mean``,
            ``last`` or ``cls``/``first``.
        normalize: unit-normalise the embeddings; ``None`` = the model's own choice (its Normalize module), else off.
        max_length: truncate texts to this many tokens; ``None`` = the model's ``max_seq_length`` (ST) or context.
    """

    def __init__(self, model: Any, *, pooling: str = "auto", normalize: bool | None = None,
                 max_length: int | None = None, dtype: str | torch.dtype | None = "auto",
                 device: str | torch.device | None = "cpu", host: PluginHost | None = None, tokenizer: Any = None,
                 model_options: Any = None):
        self.host = host or get_host()
        if pooling not in POOLING_CHOICES:
            raise RepgeomError(f"unknown pooling {pooling!r} (valid: {', '.join(POOLING_CHOICES)})")
        self.st: STConfig | None
        if isinstance(model, LoadedModel):
            self.loaded, self.source, self.st = model, model.info.name, None
        elif not isinstance(model, str):  # a model in memory: transformers, PEFT or SentenceTransformer
            self.st = st_config_of(model)
            self.loaded = as_loaded(model, tokenizer, host=self.host)
            self.source = self.loaded.info.name
        else:
            self.source, self.st = model, st_config_for(model)
            target = model
            if self.st is not None and self.st.transformer_path:
                if not Path(model).expanduser().is_dir():
                    raise RepgeomError(f"{model!r} keeps its Hugging Face model in the sub-folder "
                                       f"{self.st.transformer_path!r}; download it and pass the local folder")
                target = str(Path(model).expanduser() / self.st.transformer_path)
            self.loaded = load_model(target, dtype=dtype, device=device, host=self.host, options=model_options)
        if pooling == "st" and self.st is None:
            raise RepgeomError(f"--pooling st: {self.source!r} is not a sentence-transformers model (no modules.json "
                               "with a Pooling module); use mean, last or cls")
        use_st = self.st is not None and pooling in ("auto", "st")
        if use_st and self.st.skipped_modules:
            warnings.warn(f"the model's {', '.join(self.st.skipped_modules)} module(s) after pooling are not applied: "
                          "layer embeddings are the pooled (and optionally normalised) hidden states", stacklevel=2)
        method = self.st.pooling if use_st else ("mean" if pooling == "auto" else check_pooling(pooling))
        if normalize is None:
            normalize = bool(use_st and self.st.normalize)
        st_len = self.st.max_seq_length if self.st is not None else None
        self.max_length_is_default = max_length is None
        context = context_length(self.loaded, max_length if max_length is not None else st_len)
        self.recipe = Recipe(pooling=method, normalize=bool(normalize), max_length=context,
                             lowercase=bool(self.st is not None and self.st.lowercase))
        self.prompts = dict(self.st.prompts) if self.st is not None else {}

    # -- addresses ---------------------------------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.loaded.info.n_layers

    def addresses(self, layers: str | int | LayerRequest | Sequence[str | int]) -> list[Address]:
        """Canonical addresses of a layer request, deepest last. ``layers``: ``12``, ``"resid_post:3"``, ``"all"``,
        ``[0, 3, 6]``, ``"resid_post:[0,1]"`` ..., split by the one grammar (docs/metrics.md#layer-addresses). Two
        requested names of one tensor are merged as everywhere (see
        :func:`~repgeom_eval.modeling.addresses.resolve_request`)."""
        return list(resolve_request(layer_request(layers), self.loaded, self.host).addresses)

    def points(self, addresses: Sequence[Address]) -> dict[Address, HookPoint]:
        return resolve(list(dict.fromkeys(addresses)), self.loaded)

    def depth(self, address: Address) -> float:
        """Position on a hidden-state axis: embed 0, ``resid_post:k`` k+1, ``final`` L (sites in between)."""
        if address.site == "embed":
            return 0.0
        if address.site == "final":
            return float(self.n_layers)
        return float(address.layer or 0) + _SITE_OFFSET[address.site]

    # -- embedding ---------------------------------------------------------------------------------------------------
    def prepare(self, texts: Sequence[str]) -> list[str]:
        """The strings the tokenizer gets: lower-cased if the model's recipe says so."""
        return [t.lower() for t in texts] if self.recipe.lowercase else list(texts)

    def embed(self, texts: Sequence[str], addresses: Sequence[Address], batch_size: int = 32,
              progress: bool = False, desc: str = "forward",
              sink: Callable[[Address, torch.Tensor, torch.Tensor, list[str]], None] | None = None,
              transform: Callable[[Address, torch.Tensor], torch.Tensor] | None = None,
              raw: bool = False, dtype: Any = np.float32) -> dict[Address, np.ndarray]:
        """Embed ``texts`` at every address; one forward pass per batch, stopped after the deepest address.

        Each address is pooled as the forward pass reaches it (``Forward.texts(..., consume=...)``), so a batch holds
        one address's hidden states at a time, whatever the number of addresses.
        ``sink(address, hidden, mask, strings)``, if given, also reads each address's captured token vectors of
        every batch, with the prepared strings of its rows: registered metrics are fed from this pass.
        ``transform(address, pooled)`` (preprocessing) maps the pooled float64 vectors before unit normalisation;
        ``raw=True`` returns the pooled vectors themselves (no transform, no normalisation); ``dtype`` is the
        returned arrays' (``np.float64`` keeps the pooled vectors exactly as computed).
        """
        if batch_size < 1:
            raise RepgeomError(f"batch size must be positive, got {batch_size}")
        addresses = list(dict.fromkeys(addresses))
        texts = self.prepare(texts)
        dim = self.loaded.info.hidden_size
        out = {a: np.zeros((len(texts), dim), dtype=dtype) for a in addresses}
        if not texts:
            return out
        tok = self.loaded.tokenizer
        runnable, lengths = token_lengths(tok, texts, self.recipe.max_length)  # huge texts cut before tokenizing
        empty = sum(n == 0 for n in lengths)
        if empty:
            warnings.warn(f"{empty} text(s) tokenize to no tokens; their embeddings are zero vectors", stacklevel=2)
        order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
        with Forward(self.loaded, self.points(addresses)) as fwd, tqdm(
            total=len(order), unit="text", desc=desc, disable=not progress, leave=False
        ) as bar:
            for start in range(0, len(order), batch_size):
                rows = order[start:start + batch_size]
                strings = [texts[i] for i in rows]
                pooled: dict[Address, torch.Tensor] = {}

                def consume(addr: Address, hidden: torch.Tensor, mask: torch.Tensor, host_mask: Any,
                            strings: list[str] = strings, pooled: dict = pooled) -> None:
                    if sink is not None:
                        sink(addr, hidden, mask, strings)
                    vecs = pool(hidden.double(), mask.to(hidden.device), self.recipe.pooling)[0]
                    if not raw:
                        vecs = self.finish(addr, vecs, transform)
                    # kept where it is until the pass ends: read back inside it, a GPU would wait for each address
                    pooled[addr] = vecs.float() if dtype == np.float32 else vecs

                fwd.texts([runnable[i] for i in rows], self.recipe.max_length, "right", row_ids=rows, consume=consume)
                for addr in addresses:
                    out[addr][rows] = pooled.pop(addr).cpu().numpy()
                bar.update(len(rows))
        return out

    def finish(self, address: Address, pooled: torch.Tensor,
               transform: Callable[[Address, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Pooled float64 vectors → the embedding: preprocessing (``transform``), then unit normalisation if the
        recipe says so."""
        if transform is not None:
            pooled = transform(address, pooled)
        return unit(pooled) if self.recipe.normalize else pooled

    def forward_views(self, texts: Sequence[str], addresses: Sequence[Address], n_views: int, augmenter: object,
                      batch_size: int, sink: Callable[[Batch, list[Item]], None], progress: bool = False) -> int:
        """Run ``n_views`` augmented views of each prepared text (text ``i`` has index ``i``) through the model, cut
        into batches as ``measure`` cuts them (a text's views stay together), and hand each batch to
        ``sink(batch, items)``. Returns the number of sequences run."""
        records = [Record(i, i, t) for i, t in enumerate(texts) if t.strip()]
        plan = plan_shard(records, self.loaded.tokenizer, batch_size, n_views, False, augmenter,
                          self.recipe.max_length)
        done = 0
        with Forward(self.loaded, self.points(addresses)) as fwd, tqdm(
            total=len(plan.items), unit="view", desc="augmented views", disable=not progress, leave=False
        ) as bar:
            for unit_rows in plan.units:
                for start in range(0, len(unit_rows), batch_size):
                    rows = unit_rows[start:start + batch_size]
                    items = [plan.items[k] for k in rows]
                    batch = fwd.texts([plan.strings[k] for k in rows], self.recipe.max_length, "right",
                                      row_ids=[it.text for it in items])
                    sink(batch, items)
                    done += len(rows)
                    bar.update(len(rows))
        return done
