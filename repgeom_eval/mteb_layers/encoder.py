"""The MTEB encoder of one layer address, and the sweep that feeds many of them from one forward pass.

``LayerEncoder`` is an ``mteb.models.abs_encoder.AbsEncoder``: mteb calls ``encode(dataloader, ...)`` and scores what
it returns. Its ``ModelMeta`` carries the model's real name and revision (the Hub commit, or a content hash of a local
folder); its name carries the canonical layer address and the embedding recipe (``org/model@layer=final,pooling=mean,
normalize=False``), so every mteb cache and table keeps one model per layer: ``results/<org__model@layer=...>/<revision>/``
(mteb.evaluate's ``ResultCache`` and the legacy ``mteb.MTEB(...).run`` alike).

Several encoders can share one :class:`LayerSweep`: the first ``encode`` call for a list of texts runs one forward
pass that captures every address still to be evaluated, and the other layers' encoders answer the same texts from
that store. With registered metrics (:mod:`.metrics`), that pass also feeds them, at every captured address.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mteb.models.abs_encoder import AbsEncoder
from mteb.models.model_meta import ModelMeta, ScoringFunction

from repgeom_eval.modeling.addresses import Address
from repgeom_eval.modeling.in_memory import weights_hash
from repgeom_eval.spec.errors import RepgeomError

from .embedder import LayerEmbedder

if TYPE_CHECKING:
    import torch

    from repgeom_eval.measurement.preprocess import Preprocessor

    from .metrics import SweepMetrics

_HASH_CHUNK = 1 << 20


def _texts_key(texts: Sequence[str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in texts:
        h.update(t.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return f"{len(texts)}:{h.hexdigest()}"


class LayerSweep:
    """Embeddings of many addresses from one forward pass per batch, kept per list of texts until released.

    ``active`` holds the addresses whose evaluation on the current task is still to come: a forward pass captures
    all of them at once. :meth:`release` drops an address's vectors once its evaluation is over; :meth:`clear`
    forgets everything (between tasks).
    """

    def __init__(self, embedder: LayerEmbedder, addresses: Sequence[Address], progress: bool = False,
                 metrics: "SweepMetrics | None" = None):
        self.embedder = embedder
        self.addresses = list(dict.fromkeys(addresses))
        self.active = list(self.addresses)
        self.progress = progress
        self.metrics = metrics  # registered metrics fed from these forward passes (see .metrics)
        self.forward_passes = 0  # number of embed() calls, for tests and benchmarks
        self.said: list | None = None  # a sweep collects degenerate-number warnings here, to say them once per task
        self._store: dict[str, dict[Address, np.ndarray]] = {}
        # --preprocess (see .preprocess): the transforms, what to record, and the pooled vectors of the statistics
        # pass (address → rows, text → row), from which evaluations are answered without another forward pass
        self.prep: "Preprocessor | None" = None
        self.prep_record: str | None = None
        self._pooled: dict[Address, np.ndarray] = {}
        self._pooled_row: dict[str, int] = {}
        self.pick_records: dict[str, str] = {}  # --layer auto: task name → the pick record (see .pick)

    def _transform(self, address: Address, pooled: "torch.Tensor") -> "torch.Tensor":
        return self.prep(str(address), self.embedder.recipe.pooling, pooled)  # type: ignore[misc]

    def set_pooled(self, texts: Sequence[str], pooled: dict[Address, np.ndarray]) -> None:
        """Keep the pooled vectors of the statistics pass (row i = ``texts[i]``) to answer evaluations from."""
        self._pooled = dict(pooled)
        self._pooled_row = {t: i for i, t in enumerate(texts)}

    def _from_pooled(self, texts: Sequence[str], address: Address) -> np.ndarray | None:
        if address not in self._pooled or not all(t in self._pooled_row for t in texts):
            return None
        import torch

        rows = [self._pooled_row[t] for t in texts]
        pooled = torch.from_numpy(self._pooled[address][rows]).double()
        return self.embedder.finish(address, pooled, self._transform if self.prep is not None else None) \
            .float().numpy()

    def vectors(self, texts: Sequence[str], address: Address, batch_size: int,
                context: tuple[str, str, str] | None = None) -> np.ndarray:
        """The embeddings of ``texts`` at ``address``. With ``context`` (the evaluated task, split and subset) the
        forward pass also feeds the sweep's metrics, and stored embeddings are used only where they already did."""
        key = _texts_key(texts)
        held = self._store.get(key, {})
        metrics = self.metrics if context is not None else None
        prepared: list[str] = []
        if metrics is not None:
            prepared = self.embedder.prepare(texts)
            metrics.register(context, prepared)  # type: ignore[arg-type]

        def stale(a: Address) -> bool:
            return a not in held or (metrics is not None and metrics.missing(context, prepared, a))  # type: ignore

        if not stale(address):
            return held[address]
        if metrics is None or not metrics.missing(context, prepared, address):  # type: ignore[arg-type]
            cached = self._from_pooled(texts, address)
            if cached is not None:
                return cached
        wanted = [a for a in self.active if stale(a)]
        if address not in wanted:
            wanted.append(address)
        self.forward_passes += 1
        if metrics is not None:
            metrics.batch_size = batch_size
        got = self.embedder.embed(texts, wanted, batch_size=batch_size, progress=self.progress,
                                  desc=f"forward ({len(wanted)} layer{'s' if len(wanted) > 1 else ''})",
                                  sink=metrics.sink(context) if metrics is not None else None,  # type: ignore
                                  transform=self._transform if self.prep is not None else None)
        if len(wanted) > 1:  # something else will read these texts again: keep them
            self._store.setdefault(key, {}).update({a: v for a, v in got.items() if a != address})
        return got[address]

    def release(self, address: Address) -> None:
        for held in self._store.values():
            held.pop(address, None)
        if address in self.active:
            self.active.remove(address)

    def clear(self) -> None:
        self._store.clear()
        self._pooled, self._pooled_row = {}, {}
        self.active = list(self.addresses)
        if self.metrics is not None:
            self.metrics.clear()

    def encoder(self, address: Address, **kwargs: Any) -> "LayerEncoder":
        return LayerEncoder(self, address, **kwargs)


class LayerEncoder(AbsEncoder):
    """mteb encoder that embeds texts with one layer address of a model (see the module docstring).

    Build one with :func:`layer_encoder` (one layer) or :class:`LayerSweep` ``.encoder(address)`` (many layers
    sharing forward passes). ``name``/``revision`` default to the model's Hub id and commit, or ``local/<folder>``
    and a content hash of the folder.
    """

    def __init__(self, sweep: LayerSweep, address: Address, *, name: str | None = None, revision: str | None = None,
                 base_meta: ModelMeta | None = None):
        self.sweep = sweep
        self.address = address
        embedder = sweep.embedder
        self.model = embedder.loaded.model
        self.model_prompts = embedder.prompts or None
        self.name = name or model_name(embedder.source)
        self.revision = revision or model_revision(embedder.source, embedder.loaded)
        self._meta = self._with_identity(base_meta or _base_meta(embedder))
        self._recording = False
        self._seen: dict[tuple[str, str, str], list[tuple[list[str], np.ndarray]]] = {}

    # -- identity --------------------------------------------------------------------------------------------------
    @property
    def experiment_kwargs(self) -> dict[str, Any]:
        e = self.sweep.embedder
        return e.recipe.experiment_kwargs(self.address, e.max_length_is_default)

    @property
    def depth(self) -> float:
        return self.sweep.embedder.depth(self.address)

    @property
    def layer_name(self) -> str:
        """The name mteb sees: the model's name and this layer's recipe, ``local/x@layer=final,pooling=mean,...``."""
        return layer_model_name(self.name, self.experiment_kwargs)

    def _with_identity(self, meta: ModelMeta) -> ModelMeta:
        # One mteb model per layer and recipe: every mteb path that keys results on (name, revision) alone (the
        # legacy mteb.MTEB(...).run cache, load_results, BenchmarkResults tables) keeps the layers apart. The
        # recipe is also in loader_kwargs (canonical values), so the saved model_meta.json says how to rebuild it.
        e = self.sweep.embedder
        source = e.source if isinstance(e.source, str) else str(e.source)
        return meta.model_copy(update={
            "name": self.layer_name, "revision": self.revision, "experiment_kwargs": None,
            "loader": load_layer_encoder, "loader_kwargs": {"model": source, **self.experiment_kwargs},
            "similarity_fn_name": ScoringFunction.COSINE, "embed_dim": e.loaded.info.hidden_size,
            "n_parameters": e.loaded.info.n_parameters, "max_tokens": e.recipe.max_length,
            "use_instructions": bool(self.model_prompts),
        })

    @property
    def mteb_model_meta(self) -> ModelMeta:  # type: ignore[override]
        return self._meta

    @mteb_model_meta.setter
    def mteb_model_meta(self, meta: ModelMeta) -> None:
        # mteb.get_model() assigns a meta whose experiment_kwargs are the raw keyword arguments (layer=12); keep
        # the canonical identity, so `layer=12` and `layer="resid_post:11"` share one cached result (and the
        # layer stays in the name, not in an experiment folder).
        self._meta = self._with_identity(meta)

    # -- encoding --------------------------------------------------------------------------------------------------
    def encode(self, inputs, *, task_metadata, hf_split: str, hf_subset: str, prompt_type=None,
               **kwargs: Any) -> np.ndarray:
        texts: list[str] = []
        for batch in inputs:
            if "text" not in batch:
                raise RepgeomError(f"task {task_metadata.name!r} gives the encoder {sorted(batch)} inputs; the "
                                   "layer encoder embeds text only")
            texts.extend(batch["text"])
        bad = next((t for t in texts if not isinstance(t, str)), None)
        if bad is not None:
            raise RepgeomError(f"task {task_metadata.name!r} gives the encoder a {type(bad).__name__}, not a string")
        prompt_name = self.get_prompt_name(task_metadata, prompt_type)
        if prompt_name:
            texts = [self.model_prompts[prompt_name] + t for t in texts]  # type: ignore[index]
        batch_size = int(kwargs.get("batch_size") or getattr(inputs, "batch_size", None) or 32)
        metrics = self.sweep.metrics
        context = metrics.context(task_metadata.name, hf_split, hf_subset) if metrics is not None else None
        vectors = self.sweep.vectors(texts, self._address_for(task_metadata, hf_split, hf_subset, texts, batch_size),
                                     batch_size, context)
        if self._recording:
            self._seen.setdefault((task_metadata.name, hf_split, hf_subset), []).append((texts, vectors))
        return vectors

    def _address_for(self, task_metadata: Any, split: str, subset: str, texts: list[str], batch_size: int) -> Address:
        """The address that embeds ``texts`` (an ``auto`` encoder picks it per task)."""
        return self.address

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Keep what :meth:`encode` returns (for the geometry next to the scores) while inside this block."""
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def take_embeddings(self, task: str, split: str, subset: str) -> np.ndarray | None:
        """The embeddings of the distinct texts encoded for (task, split, subset) while recording; forgets them."""
        parts = self._seen.pop((task, split, subset), [])
        if not parts:
            return None
        rows, seen = [], set()
        for texts, vectors in parts:
            for text, vector in zip(texts, vectors):
                if text not in seen:
                    seen.add(text)
                    rows.append(vector)
        return np.stack(rows)

    def __repr__(self) -> str:
        return f"LayerEncoder({self.name!r}, layer={str(self.address)!r}, pooling={self.sweep.embedder.recipe.pooling!r})"


class AutoLayerEncoder(LayerEncoder):
    """``layer_encoder(model, layer="auto")``: the layer is picked per task by a label-free rule, on the texts of
    the task's FIRST encode call (docs/picks.md#from-python); later encodes of the task use that layer. The
    identity says ``layer=auto`` and the rule; every score dict says which layer was picked (``repgeom_layer_pick``).
    """

    def __init__(self, sweep: LayerSweep, rule: Any, **kwargs: Any):
        self.rule = rule  # before the identity is built from experiment_kwargs
        self._picked: dict[str, Address] = {}
        super().__init__(sweep, sweep.addresses[-1], **kwargs)

    @property
    def experiment_kwargs(self) -> dict[str, Any]:
        out = {**super().experiment_kwargs, "layer": "auto", "layer_pick": self.rule.name}
        changed = self.rule.changed_params()
        if changed:
            out["layer_pick_params"] = changed
        return out

    def _address_for(self, task_metadata: Any, split: str, subset: str, texts: list[str], batch_size: int) -> Address:
        from .pick import pick_layer

        task = task_metadata.name
        if task not in self._picked:
            picked = pick_layer(self.sweep.embedder, self.rule, texts, batch_size,
                                texts_note=f"the {len(texts)} texts of the task's first encode call ({split}, "
                                           f"{subset})")
            self._picked[task] = picked.chosen
            self.sweep.pick_records[task] = picked.record
            self.sweep.active = [picked.chosen]
            self.sweep.set_pooled(texts, {picked.chosen: picked.pooled[picked.chosen]})
        self.address = self._picked[task]
        return self.address


def layer_encoder(model: Any, layer: str | int = "final", *, pooling: str = "auto", normalize: bool | None = None,
                  max_length: int | None = None, dtype: str = "auto", device: str | None = "cpu",
                  name: str | None = None, revision: str | None = None, tokenizer: Any = None,
                  layer_pick: str | None = None, layer_pick_params: dict[str, Any] | None = None,
                  model_options: Any = None) -> LayerEncoder:
    """An mteb encoder for one layer of ``model``: a hub id, local folder, sentence-transformers folder or .gguf file
    (loaded with ``model_options``, a :class:`~repgeom_eval.spec.options.model.ModelOptions`), or a model in memory (a
    ``SentenceTransformer``, with its own pooling; a transformers model with its ``tokenizer``; a PEFT model). ``layer="auto"``: a layer picked per task by the rule ``layer_pick`` (default
    ``min_dataset_entropy``) with ``layer_pick_params``, on the texts of the task's first encode call."""
    from .pick import is_auto

    if is_auto(layer):
        from repgeom_eval.spec.layer_pick import make_pick

        rule = make_pick(layer_pick, layer_pick_params)  # an unknown rule fails before the model loads
        embedder = LayerEmbedder(model, pooling=pooling, normalize=normalize, max_length=max_length, dtype=dtype,
                                 device=device or "cpu", tokenizer=tokenizer, model_options=model_options)
        return AutoLayerEncoder(LayerSweep(embedder, embedder.addresses("all")), rule, name=name, revision=revision)
    if layer_pick or layer_pick_params:
        raise RepgeomError("a layer-pick rule needs layer='auto'")
    embedder = LayerEmbedder(model, pooling=pooling, normalize=normalize, max_length=max_length, dtype=dtype,
                             device=device or "cpu", tokenizer=tokenizer, model_options=model_options)
    addresses = embedder.addresses(layer)
    if len(addresses) != 1:
        raise RepgeomError(f"layer {layer!r} names {len(addresses)} addresses; an encoder embeds with one "
                           "(use repgeom_eval.mteb_layers.run_layers for a sweep)")
    return LayerSweep(embedder, addresses).encoder(addresses[0], name=name, revision=revision)


# -- names and revisions --------------------------------------------------------------------------------------------

def _local_path(source: str) -> Path | None:
    path = Path(source).expanduser()
    return path if path.exists() else None


def model_name(source: str) -> str:
    """mteb needs ``org/name``: a hub id as it is, a local folder or file as ``local/<name>``."""
    path = _local_path(source)
    if path is None:
        return source if "/" in source else f"local/{source}"
    path = path.resolve()
    stem = path.stem if path.is_file() else path.name
    if stem in ("model", "models", "checkpoint", "snapshot") and path.parent.name:
        stem = f"{path.parent.name}-{stem}"  # e.g. a pip package shipping its weights in a folder called model/
    return f"local/{stem}"


_HASHES: dict[tuple[str, float, int], str] = {}


def content_hash(path: str | Path) -> str:
    """First 16 hex digits of a SHA-256 over every file of a folder (relative names and bytes), or of one file."""
    path = Path(path).resolve()
    files = [path] if path.is_file() else sorted(
        f for f in path.rglob("*") if f.is_file() and not any(p.startswith(".") for p in f.relative_to(path).parts))
    stamp = (str(path), max((f.stat().st_mtime for f in files), default=0.0), sum(f.stat().st_size for f in files))
    if stamp in _HASHES:
        return _HASHES[stamp]
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(path) if f != path else f.name).encode() + b"\0")
        with f.open("rb") as fh:
            while chunk := fh.read(_HASH_CHUNK):
                h.update(chunk)
    _HASHES[stamp] = h.hexdigest()[:16]
    return _HASHES[stamp]


def model_revision(source: str, loaded: Any) -> str:
    """The Hub commit of a hub model, the content hash of a local folder or file, or of the weights of a model in
    memory (which may differ from any folder it came from)."""
    if loaded.info.source == "memory":
        return weights_hash(loaded.model)
    path = _local_path(source)
    if path is not None:
        return content_hash(path)
    commit = getattr(loaded.model.config, "_commit_hash", None)
    return str(commit) if commit else "no_revision_available"


GENERIC_NAME = "repgeom/layer-encoder"
_LOADER_OPTIONS = ("model", "layer", "pooling", "normalize", "max_length", "dtype", "device", "preprocess",
                   "preprocess_stats", "layer_pick", "layer_pick_params")
_UNSAFE = set('<>:"|?*\\/ @,=')


def layer_model_name(name: str, recipe: dict[str, Any]) -> str:
    """``org/model@layer=resid_post_11,pooling=mean,normalize=False``: one mteb model name per layer and recipe
    (characters that are unsafe in a folder name, or that separate the parts, become ``_``)."""
    def safe(value: Any) -> str:
        return "".join("_" if c in _UNSAFE else c for c in str(value))

    return f"{name}@" + ",".join(f"{k}={safe(v)}" for k, v in recipe.items())


def base_model_name(name: str) -> str:
    """The model's own name in a :func:`layer_model_name`."""
    return name.split("@", 1)[0]


def load_layer_encoder(name: str, revision: str | None = None, **kwargs: Any):
    """mteb ``ModelMeta.loader`` (here, beside the encoder it builds, so the registry module imports this one and not the
    reverse): builds a :class:`LayerEncoder` from ``model=`` and the layer options."""
    unknown = sorted(set(kwargs) - set(_LOADER_OPTIONS))
    if unknown:
        raise RepgeomError(f"the layer encoder has no option(s) {unknown} (options: {', '.join(_LOADER_OPTIONS)})")
    model = kwargs.pop("model", None)
    if kwargs.pop("preprocess", "none") not in (None, "none"):
        raise RepgeomError("a preprocessed layer needs statistics from texts: use "
                           "repgeom_eval.mteb_layers.run_layers(..., preprocess=...) or `repgeom mteb run --preprocess`")
    kwargs.pop("preprocess_stats", None)
    if not model:
        raise RepgeomError(f"{name}: say which model to embed with, e.g. "
                           f"mteb.get_model({GENERIC_NAME!r}, model='path/or/hub-id', layer=12)")
    own_name = None if name == GENERIC_NAME else base_model_name(name)  # a saved per-layer meta: its model's name
    return layer_encoder(model, kwargs.pop("layer", "final"), name=own_name,
                         revision=None if own_name is None else revision, **kwargs)


def _base_meta(embedder: LayerEmbedder) -> ModelMeta:
    info = embedder.loaded.info
    frameworks = ["PyTorch", "Transformers"] + (["Sentence Transformers"] if embedder.st else []) + \
        (["GGUF"] if info.source == "gguf" else [])
    return ModelMeta(
        loader=load_layer_encoder, loader_kwargs={"model": embedder.source}, name="repgeom/layer-encoder",
        revision=None, release_date=None, languages=None, n_parameters=info.n_parameters, memory_usage_mb=None,
        max_tokens=None, embed_dim=info.hidden_size, license=None, open_weights=None, public_training_code=None,
        public_training_data=None, framework=frameworks, similarity_fn_name=ScoringFunction.COSINE,
        use_instructions=False, training_datasets=None, modalities=["text"],
    )
