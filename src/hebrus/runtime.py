"""`hebrus.load` and `Model`: weights on a device, a mode, the stage list and the owner table."""
from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Iterator

import torch

from hebrus.arguments import count
from hebrus.errors import CheckpointError, InvalidInput
from hebrus.layers.graph import build_stages
from hebrus.layers.kernels import Chooser, kernels, top_k_chooser
from hebrus.layers.layout import side_by_side
from hebrus.layers.owners import owner_specs
from hebrus.layers.shard import shard_params, shard_spec, weight_parts
from hebrus.layers.spec import ModelSpec
from hebrus.models import family_of, layout
from hebrus.models.hebrus import PRESETS, HebrusConfig, preset
from hebrus.ops.norm import accum_dtype
from hebrus.presets import TRAINED, names
from hebrus.show import shown
from hebrus.state.owners import OwnerSpec
from hebrus.state.pool import Pool, PoolSize
from hebrus.weights import checkpoint
from hebrus.weights.files import folder_path
from hebrus.weights.pages import DEFAULT_PAGE_ROWS, FileRows, HostRows, PagedTable
from hebrus.ops.quant import all_finite, check_cache_format
from hebrus.weights.quant import Quantization, check_parts, quantize_params

MODES = ("exact", "fast")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


_POOLS = threading.Lock()          # a model's pool is carved once


class Model:
    def __init__(self, config: HebrusConfig, params: dict[str, torch.Tensor], *,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, mode: str = "exact",
                 chooser: Chooser | None = None, ple_cache_bytes: int | None = None):
        device, mode = resolve_device(device), _mode(mode)
        placed = {name: _place(name, t, _home(name, device, ple_cache_bytes), layout.storage_dtype(name, dtype))
                  for name, t in params.items()}
        self._build(config, config.spec(), placed, device, dtype, mode, chooser, paging=ple_cache_bytes)

    @classmethod
    def _placed(cls, config, spec: ModelSpec, params, device, dtype, mode, chooser=None,
                source: Path | None = None, paging: int | None = None, ranks=None) -> "Model":
        """A model on parameters already placed (by `_place`), as a checkpoint load leaves them."""
        model = cls.__new__(cls)
        model._build(config, spec, params, device, dtype, mode, chooser, source, paging, ranks)
        return model

    def on_ranks(self, ranks, device: torch.device | None = None) -> "Model":
        """Rank `ranks.rank`'s part of this model over `ranks.world` ranks (`layers.shard`: its
        spec and its part of every weight, each split one a copy of its own, on `device`, by
        default this model's), stepping with the other ranks through `ranks` (`engine.ranks.Ranks`).
        `hebrus.load(..., tensor_parallel=N)` makes one in each rank's process (`hebrus.parallel`)."""
        if self.paged:
            raise InvalidInput("tensor parallelism keeps PLE tables resident: load without ple_cache_bytes")
        device = self.device if device is None else device
        spec = shard_spec(self.spec, ranks.world)
        params = {name: part.to(device) for name, part in
                  shard_params(self.spec, self._params, ranks.rank, ranks.world).items()}
        return self._sized(Model._placed(self.config, spec, params, device, self.dtype, self.mode,
                                         self._chooser(), self.source, ranks=ranks), split=True)

    def _build(self, config, spec, params, device, dtype, mode, chooser=None, source: Path | None = None,
               paging: int | None = None, ranks=None) -> None:
        mode = _mode(mode)
        self.ranks = ranks          # a tensor-parallel model's rank (`engine.ranks.Ranks`), or None
        self.source = source                                        # the folder it was loaded from
        self.config, self.spec, self.device, self.dtype, self.mode = config, spec, device, dtype, mode
        self.state_dtype = accum_dtype(dtype)
        self.paging = paging
        self.paged = paged_tables(params, paging, device) if paging is not None else {}
        if paging is not None and not self.paged:
            raise InvalidInput(f"ple_cache_bytes pages per-layer-embedding tables; this {spec.family} model has none")
        side_by_side(spec, params)          # each kind's projections of one input in one tensor
        # a table read from its file is no parameter in memory; one in host memory stays one
        self._params = {name: (self.paged[name].source.tensor if name in self.paged else p)
                        for name, p in params.items()
                        if not (name in self.paged and isinstance(self.paged[name].source, FileRows))}
        self.weight_storages = frozenset(p.untyped_storage().data_ptr() for p in self._params.values())
        self.kernels = kernels(mode, chooser, device, dtype, ranks)  # the op table, chosen once, here
        weights = layout.as_layers_read(spec, {**self._params, **self.paged}, self.kernels.quantized_linear)
        self.stages = build_stages(spec, weights, self.kernels)
        self.owners: list[OwnerSpec] = owner_specs(spec, dtype, self.state_dtype)
        self.pool_size, self._pool = PoolSize(), None
        self._steps: dict[bool, object] = {}

    def steps(self, capture: bool):
        """The runner of this model's planned steps, for any of its sessions
        (`engine.graphs.Steps`): with `capture`, from CUDA graphs."""
        from hebrus.engine.graphs import Steps
        with _POOLS:
            if capture not in self._steps:
                self._steps[capture] = Steps(self, capture)
            return self._steps[capture]

    @property
    def pool(self) -> Pool:
        """The state pool every session of this model lives in (`state.pool`), carved the first
        time a session needs it, at `pool_size` (`hebrus.load(pool_bytes=, memory_fraction=)`)."""
        with _POOLS:
            if self._pool is None:
                self._pool = self.pool_size.carve(self.owners, self.device, self.spec.max_context)
            return self._pool

    def _sized(self, model: "Model", split: bool = False) -> "Model":
        """`model` (made from this one) with this one's pool size, and a pool of its own."""
        if self.ranks is not None and not split:
            raise InvalidInput("a tensor-parallel model's part is not remade on one rank: load the model again "
                               "with the options wanted (mode, dtype, kv_cache, ...)")
        model.pool_size = self.pool_size
        return model

    @property
    def family(self) -> str:
        return self.spec.family

    @property
    def stage_names(self) -> list[str]:
        return [stage.name for stage in self.stages]

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._params.items()

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write this model as a Hebrus checkpoint into the folder `path` (new or empty; with
        `overwrite`, a folder that holds anything is replaced whole), with the tokenizer, chat
        template and generation config of the folder it was loaded from."""
        if not isinstance(self.config, HebrusConfig):
            raise InvalidInput(f"save writes Hebrus checkpoints; this model is {self.spec.family}, whose own "
                               f"checkpoint it was loaded from")
        if self._in_files():
            raise InvalidInput("save needs every weight in memory; this model reads its PLE tables from its "
                               "checkpoint file (load it without ple_cache_bytes to save it)")
        if self.spec.replace(quantization=None, kv_cache=None) != self.config.spec():
            raise InvalidInput("save writes the model's config.json; this model's layers are not the ones its "
                               "config describes (built on another spec), so the folder would not load back")
        return checkpoint.save(path, self.config, self._params, self.spec.quantization, overwrite=overwrite,
                               companions=self.source)

    def with_kv_cache(self, kv_cache: str | None) -> "Model":
        """The same weights (shared) with attention's K/V rows and index keys stored as "int8"
        or "fp8" codes with a float32 scale per row (per head of a K/V row), or None: in the
        model's dtype."""
        return self._sized(Model._placed(self.config, _cached(self.spec, kv_cache), {**self._params, **self._in_files()},
                             self.device, self.dtype, self.mode, self._chooser(), self.source, self.paging))

    def quantized(self, quantize) -> "Model":
        """The same model with its large projections quantized (`weights.quant`): "int8",
        "int4", "int4-zp" (int4 with zero points), "fp8", or a `Quantization`. The other
        weights are shared with this model, not copied."""
        return self._sized(self._quantized(Quantization.parse(quantize)))

    def _quantized(self, q: Quantization) -> "Model":
        """`quantized`'s model (a rank's part quantized as a part of the same ranks)."""
        if self.spec.quantization is not None:
            raise InvalidInput(f"this model is already quantized ({self.spec.quantization.name}); load its "
                               f"float checkpoint to quantize it otherwise")
        params = quantize_params(self._params, q, layout.quantized(self.spec))
        check_parts(params, q)                  # what a save would write must load again
        return Model._placed(self.config, self.spec.replace(quantization=q), {**params, **self._in_files()},
                             self.device, self.dtype, self.mode, self._chooser(), self.source, self.paging, self.ranks)

    def _in_files(self) -> dict[str, FileRows]:
        """The paged tables read from their checkpoint file (no parameter in memory)."""
        return {name: t.source for name, t in self.paged.items() if isinstance(t.source, FileRows)}

    def with_mode(self, mode: str, chooser: Chooser | None = None) -> "Model":
        """The same weights (shared, not copied) run in `mode`, making discrete choices with
        `chooser` (default: the spec's top-k; see `hebrus.layers.kernels`)."""
        return self._sized(Model._placed(self.config, self.spec, {**self._params, **self._in_files()}, self.device, self.dtype,
                             mode, chooser, self.source, self.paging))

    def with_paging(self, ple_cache_bytes: int | None) -> "Model":
        """The same weights with the PLE tables served through a cache of `ple_cache_bytes` of
        device memory (empty: a fresh cache; 0: every lookup read from the tables' source), or
        resident with None (read into memory from their source)."""
        if ple_cache_bytes is not None:
            ple_cache_bytes = count("ple_cache_bytes", ple_cache_bytes)
        params = {**self._params, **self._in_files()}
        if ple_cache_bytes is None:                 # every table read whole onto the device
            params = {name: (_place(name, rows.read(0, rows.shape[0]) if isinstance(rows, FileRows) else rows,
                                    self.device, self.paged[name].dtype) if name in self.paged else rows)
                      for name, rows in params.items()}
        return self._sized(Model._placed(self.config, self.spec, params, self.device, self.dtype, self.mode,
                             self._chooser(), source=self.source, paging=ple_cache_bytes))

    def _chooser(self) -> Chooser | None:
        return None if self.kernels.choose is top_k_chooser else self.kernels.choose

    def with_dtype(self, dtype: torch.dtype | str) -> "Model":
        """A copy of the weights in `dtype` (each converted from this model's), same mode and
        device. For comparisons: a float32 model against its float64 twin."""
        dtype = resolve_dtype(dtype)
        params = {name: _place(name, p, _home(name, self.device, self.paging), layout.storage_dtype(name, dtype))
                  for name, p in self._params.items()}
        params.update({name: rows.with_dtype(dtype) for name, rows in self._in_files().items()})
        return self._sized(Model._placed(self.config, self.spec, params, self.device, dtype, self.mode, source=self.source,
                             paging=self.paging))

    @property
    def prefill_chunk(self) -> int:
        """The chunk a prompt is fed in when the caller names none (`Session.prefill`,
        `generate`, the text API): 8192 tokens in fast mode on a GPU, where a chunk's launches
        cost the host about the same at any length; 512 otherwise, where a longer chunk gains
        little and a shorter one lets progress and Ctrl-C come sooner. A longer chunk needs more
        working memory (a session with a memory budget may need a smaller `chunk_size`). Exact
        mode publishes the same bits at any chunking, fast mode the same within its bound."""
        return 8192 if self.device.type == "cuda" and self.mode == "fast" else 512

    def session(self, memory_budget: int | None = None, decode: str = "auto", reserve: int = 0, journal=None):
        """A new conversation. `decode` says how one-token steps run: "auto" (CUDA graphs for a
        fast-mode model on a GPU, else eager), "eager", "planned" (the graph's static plan run
        op by op, any device) or "graph". `reserve`: how many positions the session expects to
        reach; its row logs (K/V, index keys, routes) grow straight to that many rows the first
        time they grow, so a long decode never stops to copy them (if the memory budget refuses
        the reservation, they grow as needed instead). `journal`: a new file where each chunk's
        token ids are written and flushed before the chunk is published (`hebrus.journal`;
        after a crash, `recover` reaches every committed chunk)."""
        from hebrus.session import Session
        return Session(self, memory_budget=memory_budget, decode=decode, reserve=reserve, journal=journal)

    def restore(self, path, memory_budget: int | None = None, decode: str = "auto", reserve: int = 0):
        """A session exactly as `Session.save` wrote it to `path` (the same digest), or
        InvalidInput when the file is not a session of this model or is damaged."""
        s = self.session(memory_budget=memory_budget, decode=decode, reserve=reserve)
        s._restore(path)
        return s

    def from_host(self, copy, memory_budget: int | None = None, decode: str = "auto", reserve: int = 0):
        """A session holding exactly what `copy` (`Session.host_copy` of a session of this model)
        holds: the same digest. AllocationError when the pool has no slot or blocks for it."""
        s = self.session(memory_budget=memory_budget, decode=decode, reserve=reserve)
        s._install(copy, "the copied session")
        return s

    def recover(self, journal, snapshot=None, memory_budget: int | None = None, decode: str = "auto",
                reserve: int = 0):
        """After a crash: the session of `snapshot` (a file `Session.save` wrote; None: from the
        empty state) with the chunks of `journal` past it fed again, each as it was, then
        journaling on into the same file. Every chunk whose call returned is in the journal."""
        from hebrus import journal as journals
        records, _, _ = journals.read(journal, self.fingerprint, self.spec.max_context)
        s = self.restore(snapshot, memory_budget, decode, reserve) if snapshot is not None else \
            self.session(memory_budget, decode, reserve)
        journals.replay(s, records)
        end = records[-1].start + records[-1].kept if records else 0
        if end != s.frontier:                   # refused before the journal is opened: it stays as it is
            raise InvalidInput(f"{journal} ends at position {end}, the recovered session at {s.frontier}")
        s.journal = journals.Journal(journal, self.fingerprint, self.spec.max_context)    # the torn tail cut off
        if s.journal.frontier != s.frontier:    # the file changed since it was read
            s.journal.close()
            raise InvalidInput(f"{journal} changed while the session was recovered from it; recover again")
        return s

    @functools.cached_property
    def tokenizer(self):
        """Text to ids and back (`hebrus.text.tokenizers`): the checkpoint's tokenizer.json, chat
        template and generation config, or bytes (token id = byte) for a model without one."""
        from hebrus.text.tokenizers import tokenizer_for
        return tokenizer_for(self)

    @functools.cached_property
    def fingerprint(self) -> str:
        """SHA-256 of the owner table and every weight (`snapshot.model_fingerprint`)."""
        from hebrus.snapshot import model_fingerprint
        return model_fingerprint(self)

    def __repr__(self) -> str:
        c = self.spec
        return (f"Model(family={c.family}, layers={c.mixers}, hidden={c.hidden_size}, vocab={c.vocab_size}, "
                f"device={self.device}, dtype={str(self.dtype).removeprefix('torch.')}, mode={self.mode!r})")


def load(name_or_path: str | Path = "tiny", *, device: str | torch.device = "cpu",
         dtype: torch.dtype | str = torch.float32, mode: str = "exact", progress=None,
         ple_cache_bytes: int | None = None, quantize: str | None = None, kv_cache: str | None = None,
         pool_bytes: int | None = None, memory_fraction: float | None = None, tensor_parallel: int | None = None,
         rendezvous: str | None = None, rank_timeout: float = 60.0) -> Model:
    """A preset name (trained: `hebrus.presets`; or random, initialised from the config's seed:
    `tiny`, `small`), a checkpoint directory of
    any supported family (`hebrus.models`), or a Hugging Face repo id ("Org/Name"), taken from
    the local cache or downloaded into it (`hebrus.hub.fetch`). Every argument is checked
    before anything is read or allocated; bad ones raise InvalidInput. `progress(done, total)` follows a checkpoint's tensors as they load.
    `quantize`: quantize the large projections as the model loads (`Model.quantized`); a
    checkpoint stored quantized (its config's `quantization_config`) loads as it is stored.
    `kv_cache`: "int8" or "fp8" to keep attention's rows as codes with a scale per row
    (`Model.with_kv_cache`). `device="auto"`: CUDA when there is one, else the CPU;
    `dtype="auto"`: bfloat16 on a GPU, float32 on the CPU. The sessions' state lives in one
    pool (`state.pool`) of `pool_bytes`, or `memory_fraction` of the device's free memory when
    the pool is carved (at the first session); by default a quarter of the host's memory on the
    CPU (touched only as sessions use it) and 30% of the free memory on a GPU.

    `tensor_parallel=N`: the model split over N ranks, one process each, this one rank 0 (a
    `hebrus.parallel.ParallelModel`; the others started here, or with `rendezvous="HOST:PORT"`
    joined from other hosts by `hebrus worker`); a collective that takes more than
    `rank_timeout` seconds means a rank is lost."""
    check_cache_format(kv_cache)                            # before anything is read
    size = PoolSize(pool_bytes, memory_fraction).checked()
    if tensor_parallel is not None or rendezvous is not None:
        return _parallel(name_or_path, tensor_parallel, rendezvous, rank_timeout, device=device, dtype=dtype,
                         mode=mode, ple_cache_bytes=ple_cache_bytes, quantize=quantize, kv_cache=kv_cache,
                         pool_bytes=pool_bytes, memory_fraction=memory_fraction)
    model = _load(name_or_path, device, dtype, mode, progress, ple_cache_bytes, Quantization.parse(quantize)
                  if quantize is not None else None)
    model = model.quantized(quantize) if quantize is not None else model
    model = model.with_kv_cache(kv_cache) if kv_cache is not None else model
    model.pool_size = size
    return model


def _parallel(name_or_path, world, rendezvous, timeout, **options):
    """`load` over `world` ranks (`hebrus.parallel.launch`), its arguments checked here first."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise InvalidInput(f"tensor_parallel must be a number of ranks (1 or more), got {world!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 1 <= timeout < float("inf"):
        raise InvalidInput(f"rank_timeout must be a number of seconds, at least 1, got {timeout!r}")
    given = options["device"]
    if resolve_device(given).type == "cuda":            # a clear error for a device there is not
        if not (isinstance(given, str) and given == "auto") and torch.device(given).index is not None:
            raise InvalidInput(f"under tensor parallelism rank r computes on cuda:r; give device='cuda', not {given}")
        if rendezvous is None and torch.cuda.device_count() < world:
            raise InvalidInput(f"{world} ranks on this host need {world} CUDA devices (one a rank); "
                               f"{torch.cuda.device_count()} are visible")
    if options["quantize"] is not None:
        Quantization.parse(options["quantize"])             # a format there is not: refused here
    if options["ple_cache_bytes"] is not None and isinstance(name_or_path, str) and name_or_path in PRESETS:
        raise InvalidInput("under tensor parallelism PLE tables are paged from a checkpoint's file: save the preset "
                           "(hebrus.load(name).save(folder)) and load the folder with ple_cache_bytes")
    from hebrus import parallel
    return parallel.launch(name_or_path, options, world, rank_model, rendezvous, float(timeout))


def rank_model(plan, rank: int, store) -> Model:
    """Rank `rank`'s part of `plan`'s model (`hebrus.parallel.calls.Plan`), in the ranks' process
    group, on the rank's device (NCCL: cuda:rank): from a checkpoint, each weight is read, cut to
    this rank's part and placed before the next is read, so a rank holds its part and one whole
    weight at a time (the model need fit neither one device nor one rank's host memory); a
    preset's random weights are made whole in host memory, then split (`Model.on_ranks`). With
    `quantize`, each rank quantizes its float part."""
    from hebrus import parallel
    from hebrus.engine.ranks import Ranks
    o = plan.options
    device = parallel.init_group(plan, rank, store) or resolve_device(o["device"])
    model = _load(plan.source, device, o["dtype"], o["mode"], None, o["ple_cache_bytes"], None,
                  Ranks(rank, plan.world, None, device), o["kv_cache"])
    if o["quantize"] is not None:           # each rank quantizes its part (a split row's scales are its part's)
        model = model._quantized(Quantization.parse(o["quantize"]))
    model.pool_size = PoolSize(o["pool_bytes"], o["memory_fraction"]).checked()
    return model


def _load(name_or_path, device, dtype, mode, progress, ple_cache_bytes, quantize, ranks=None,
          kv_cache: str | None = None) -> Model:
    """The model `load` names (`ranks`: that rank's part of it, with `kv_cache` taken here; else
    `load` takes it after)."""
    device, mode = resolve_device(device), _mode(mode)
    dtype = _auto_dtype(device) if isinstance(dtype, str) and dtype == "auto" else resolve_dtype(dtype)
    if ple_cache_bytes is not None:
        ple_cache_bytes = count("ple_cache_bytes (bytes of device memory for PLE pages, or None to keep "
                                "the tables resident)", ple_cache_bytes)
    if isinstance(name_or_path, str) and name_or_path in PRESETS:
        config = preset(name_or_path)
        if ranks is not None:
            whole = Model(config, config.init_parameters(), dtype=dtype, mode=mode)
            return whole.with_kv_cache(kv_cache).on_ranks(ranks, device)
        return Model(config, config.init_parameters(), device=device, dtype=dtype, mode=mode,
                     ple_cache_bytes=ple_cache_bytes)
    if isinstance(name_or_path, str) and name_or_path in TRAINED:
        path = TRAINED[name_or_path]
    else:
        path = folder_path(name_or_path, "the model (a preset name, a checkpoint directory or a repo id)")
    if not _is_dir(path):
        if not isinstance(name_or_path, str):               # a path is never looked up as a repo id
            raise InvalidInput(f"{path} is neither a preset ({', '.join(names())}) nor a checkpoint directory")
        path = _repo(name_or_path)

    def place(name: str, tensor: torch.Tensor) -> torch.Tensor:
        return _place(name, tensor, device, layout.storage_dtype(name, dtype), fresh=True)

    def dtype_of(name: str) -> torch.dtype:                  # on the CPU, convert while reading
        return layout.storage_dtype(name, dtype)

    def stream(name: str) -> torch.dtype | None:            # PLE tables stay in their file when paged
        return layout.storage_dtype(name, dtype) if ple_cache_bytes is not None and name.startswith(PAGED) else None

    def split(spec: ModelSpec):                             # each weight cut to this rank's part as it is read
        return shard_spec(spec, ranks.world), weight_parts(spec, ranks.rank, ranks.world)

    loaded = checkpoint.load(path, family_of, place, progress, dtype_of if device.type == "cpu" else None,
                             dtype=dtype, device=device, stream=stream, layout=layout,
                             split=split if ranks is not None else None)
    if quantize is not None and loaded.spec.quantization is not None:
        raise InvalidInput(f"{path} is stored quantized ({loaded.spec.quantization.name}); load it without "
                           f"quantize")
    try:
        check_parts(loaded.params, loaded.spec.quantization, where=str(path))
    except InvalidInput as exc:
        raise CheckpointError(str(exc)) from None
    spec = loaded.spec if ranks is None else _cached(loaded.spec, kv_cache)
    return Model._placed(loaded.config, spec, loaded.params, device, dtype, mode,
                         source=Path(os.path.abspath(path)), paging=ple_cache_bytes, ranks=ranks)


def _cached(spec: ModelSpec, kv_cache: str | None) -> ModelSpec:
    """`spec` with attention's rows kept as `kv_cache` codes (`Model.with_kv_cache`)."""
    check_cache_format(kv_cache)
    if kv_cache is not None and not spec.keeps_rows:
        raise InvalidInput(f"kv_cache quantizes attention's rows (attention, qsa and latent attention layers); "
                           f"this {spec.family} model has none")
    return spec.replace(kv_cache=kv_cache)


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:                                         # a name too long for the file system
        return False


def _repo(name) -> Path:
    """The local snapshot of a Hugging Face repo id (Org/Name): from the cache, or fetched into
    it when missing (`hebrus.hub`: only the files hebrus reads; HF_HUB_OFFLINE keeps it to the
    cache)."""
    from hebrus import hub
    try:
        repo = hub.check_repo_id(name)
    except InvalidInput:
        raise InvalidInput(f"{shown(name)} is neither a preset ({', '.join(names())}), a checkpoint directory, "
                           f"nor a Hugging Face repo id (Org/Name)") from None
    try:
        return hub.cached(repo) or hub.fetch(repo)
    except InvalidInput as exc:
        parent = Path(repo).parent
        if not _is_dir(parent):
            raise
        raise InvalidInput(f"{repo} is not a checkpoint directory (the folder {parent} here has no "
                           f"{Path(repo).name}), nor a repo the hub gave: {exc}") from None


def _mode(mode) -> str:
    if not isinstance(mode, str) or mode not in MODES:
        raise InvalidInput(f"unknown mode {mode!r}; modes are: {', '.join(MODES)}")
    return mode


def _place(name: str, tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None,
           fresh: bool = False) -> torch.Tensor:
    """A fresh copy in the model's dtype (a `fresh` tensor, one the loader just read into a
    buffer of its own and checked to be finite, is kept when it already is one); a weight that
    does not fit that dtype (1e5 in float16) would turn every chunk non-finite, so it is refused.
    `dtype` None: kept in its own dtype (a quantized weight's codes)."""
    if dtype is None:
        dtype = tensor.dtype
    if fresh and tensor.device == device and tensor.dtype == dtype and tensor.is_contiguous():
        return tensor                           # the loader checked it is finite as it read it
    if not fresh and not all_finite(tensor):
        raise InvalidInput(f"weight {name} holds NaN or infinite values; weights must be finite")
    placed = torch.empty(tensor.shape, dtype=dtype, device=device)
    checkpoint.converted(placed, tensor, name)
    return placed


def resolve_device(device: str | torch.device) -> torch.device:
    """An explicit, usable device: 'cuda' becomes 'cuda:<current>', so it compares equal to
    tensors' devices; 'auto' is CUDA when there is a device, else the CPU. Anything else than
    the CPU or a visible CUDA device is InvalidInput."""
    if isinstance(device, str) and device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidInput(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise InvalidInput(f"device type {device.type!r} is not supported; use 'cpu', 'cuda' or 'cuda:N'")
    if not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise InvalidInput(f"device {str(device)!r} asked for, but no CUDA device is available "
                           f"(torch {torch.__version__}, {build}); use --device cpu")
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    if device.index >= count:
        raise InvalidInput(f"device {str(device)!r} does not exist; {count} CUDA device(s) are visible")
    return device


def _auto_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on a GPU (its 16-bit matrix units); float32 on the CPU, where 16-bit arithmetic
    is slower, not faster."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise InvalidInput(f"unsupported dtype {dtype!r}; use one of: {', '.join(DTYPES)} "
                       f"(or auto, where a model loads)")


PAGED = ("ple.unigram.weight", "ple.ngram.")      # the tables `ple_cache_bytes` streams


def _home(name: str, device: torch.device, paging: int | None) -> torch.device:
    """Where a weight is placed: paged tables stay in host memory (never whole on the device)."""
    return torch.device("cpu") if paging is not None and name.startswith(PAGED) else device


def paged_tables(params: dict[str, torch.Tensor], cache_bytes: int, device: torch.device,
                 page_rows: int = DEFAULT_PAGE_ROWS) -> dict[str, PagedTable]:
    """The per-layer-embedding tables, each moved to host memory and served in pages through a
    device pool. A table small enough to be held whole by at most 1/SMALL_SHARE of `cache_bytes`
    (a unigram table, say) gets a pool that holds every page, so it is read from the host once;
    the others share the rest of `cache_bytes` in proportion to their sizes."""
    sources = {n: (p if isinstance(p, FileRows) else HostRows(p.detach().to("cpu"), pin=device.type == "cuda"))
               for n, p in params.items() if n.startswith(PAGED) and len(p.shape) == 2}

    def page_bytes(source) -> int:
        return page_rows * source.shape[1] * source.dtype.itemsize

    frames = {}
    for name, source in sources.items():
        whole = PagedTable.frames_to_hold(-(-source.shape[0] // page_rows))
        if whole * page_bytes(source) <= cache_bytes // SMALL_SHARE:
            frames[name] = whole
    left = cache_bytes - sum(frames[n] * page_bytes(sources[n]) for n in frames)
    total = sum(s.nbytes for n, s in sources.items() if n not in frames)
    for name, source in sources.items():
        if name not in frames:
            frames[name] = left * source.nbytes // max(total, 1) // page_bytes(source)
    return {name: PagedTable(source, frames[name], device, page_rows) for name, source in sources.items()}


SMALL_SHARE = 8
