"""A vLLM KV connector that stages a finished prefill's KV blocks for Ray to carry.

Load it with ``kv_transfer_config = {"kv_connector": "KairosKVConnector",
"kv_connector_module_path": "kairos_ray.kv.connector", "kv_role":
"kv_producer" | "kv_consumer", "kv_load_failure_policy": "recompute",
"kv_connector_extra_config": {"staging_dir": <the engine's staging
directory>}}``, as ``engines.vllm_engine.engine_args`` does: the engine owns
that directory (``kv.staging``), so the connector is told it, never guesses.

Producer (prefill node): a request sent with ``kv_transfer_params =
{"do_remote_decode": true}`` is watched step by step; in the step that
computes its prompt's last chunk (however many chunks came before), every
layer's blocks of the request are copied out, whole, into one staged file
per tensor-parallel rank under ``staging_dir``. The blocks are then freed at
once (the copy holds the KV), and the request's output carries
``kv_transfer_params = {"kairos_kv": <staged path>, "num_tokens": n,
"kairos_skip_tokens": s}``. ``kairos_ray.engines.vllm_engine`` reads the
staged bytes (``kv.staging``), hands them to the decode node
(``kv.transport``) and deletes the file.

A partly cached prompt: when the caller says the decode node's prefix cache
holds the prompt's first tokens (``kairos_skip_tokens`` in the request's
``kv_transfer_params``, from the router's mirror of that node's cache), the
blocks those tokens fill are not staged, so they do not travel: ``s`` is
that many whole blocks, at most the blocks before the prompt's last token.

With ``kv_connector_extra_config = {"hold_blocks_until_taken": true}`` the
producer instead keeps the request's blocks until the decode node has the KV:
the engine then leaves a ``<staged file>.taken`` marker per rank, the worker
reports the request as finished sending and vLLM frees the blocks (after
``hold_timeout_s``, 120 s, they are freed in any case). vLLM keeps stepping
while blocks are held, so an otherwise idle prefill engine polls meanwhile.

Consumer (decode node): the engine writes the bytes it fetched from the
object store under its own ``staging_dir`` and submits the request with
those ``kv_transfer_params``. The connector claims the prompt's first ``n -
1`` tokens as external (the last one is recomputed, so this node's own
forward pass yields the first token), less the leading ones this node's
prefix cache holds already (whose staged blocks are skipped), loads the
blocks synchronously before the step's forward and deletes the file. A staged file that is missing
claims nothing (the request is recomputed from scratch), nor does one that
starts past this node's own hit (the first ``s`` tokens were not sent and
the blocks that held them were evicted meanwhile: vLLM computes the prompt
from its hit); one that cannot be read or does not match reports its blocks
as failed, and vLLM's ``kv_load_failure_policy: recompute`` recomputes them.

Whole blocks travel, not token slots: attention backends lay a block out
differently (the CPU backend interleaves keys and values inside a block), so
copying whole blocks by their index is the one layout-free move. The last
block's slots past the prompt are overwritten as decoding goes on.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from kairos_ray.kv.staging import (
    HOLD_KEY,
    KV_PATH,
    KV_TOKENS,
    REMOTE_DECODE,
    SKIP_TOKENS,
    TAKEN,
    open_private,
    private_dir,
    rank_path,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except (AssertionError, AttributeError):  # no model parallel group: one rank
        return 0


def _block_dim(layer: torch.Tensor, num_blocks: int) -> int:
    """The dimension of a layer's KV tensor that indexes blocks (0 on CPU, 1 where K and V lead)."""
    for dim, size in enumerate(layer.shape):
        if size == num_blocks:
            return dim
    raise ValueError(f"no dimension of size {num_blocks} (the block count) in a KV tensor of shape {layer.shape}")


@dataclass
class _Transfer:
    path: str  # staged path prefix
    block_ids: list[int]
    req_id: str = ""
    first_block: int = 0  # a load: the staged block that goes into block_ids[0] (the blocks before are cached)


@dataclass
class _Watched:
    """A producer's request whose KV a step will stage."""

    prompt_tokens: int
    block_ids: list[int]  # its blocks so far, in order
    skip_blocks: int = 0  # leading blocks the decode node holds: not staged


@dataclass
class KairosKVMetadata(KVConnectorMetadata):
    saves: list[_Transfer] = field(default_factory=list)
    loads: list[_Transfer] = field(default_factory=list)


class KairosKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._num_blocks = kv_cache_config.num_blocks
        extra = self._kv_transfer_config.get_from_extra_config
        staging_dir = extra("staging_dir", None)
        if not staging_dir:  # the engine names its own directory (engines.vllm_engine.engine_args): no guessing
            raise ValueError("the Kairos KV connector needs kv_connector_extra_config.staging_dir, the engine's")
        self._dir = str(staging_dir)
        self._hold = bool(extra(HOLD_KEY, False))
        self._hold_timeout_s = float(extra("hold_timeout_s", 120.0))
        private_dir(self._dir)
        # scheduler side
        self._watched: dict[str, _Watched] = {}  # producer: the requests it stages, by id
        self._staging: set[str] = set()  # producer: watched requests whose KV a step stages
        self._pending_loads: list[_Transfer] = []  # consumer: loads planned for the next step
        self._local_hits: dict[str, int] = {}  # consumer: request id -> its own cached tokens, as vLLM gave them
        # worker side
        self._saving: dict[str, dict[str, torch.Tensor]] = {}  # path -> layer -> its blocks, this step
        self._failed_blocks: set[int] = set()
        self._held: dict[str, tuple[str, float]] = {}  # request id -> (its staged file, when), blocks held
        self._finished: set[str] = set()  # held requests vLLM has reported finished

    # ---- scheduler side --------------------------------------------------------------

    def _staged_path(self, request_id: str) -> str:
        return os.path.join(self._dir, re.sub(r"[^A-Za-z0-9_.-]", "_", request_id))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        path = params.get(KV_PATH)
        if not path or not os.path.exists(rank_path(str(path), 0)):
            return 0, False
        # the last prompt token is recomputed here: its forward pass gives the first token
        staged = min(int(params.get(KV_TOKENS, 0)), len(request.prompt_token_ids or ())) - 1
        skipped = int(params.get(SKIP_TOKENS, 0))
        if num_computed_tokens < skipped:  # the blocks the producer left out are no longer cached here
            logger.warning(
                "request %s: %d leading tokens were not sent (cached here), %d are now: computing the rest here",
                request.request_id,
                skipped,
                num_computed_tokens,
            )
            return 0, False
        # the external tokens follow this node's own prefix hit (block-aligned): remember where they start
        self._local_hits[request.request_id] = num_computed_tokens
        return max(0, staged - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        # vLLM sets a new request's num_computed_tokens only after this call: the local hit is the one it gave
        # get_num_new_matched_tokens
        computed = self._local_hits.pop(request.request_id, 0)
        if num_external_tokens <= 0:
            return
        params = request.kv_transfer_params or {}
        first = computed // self._block_size
        last = -(-(computed + num_external_tokens) // self._block_size)
        ids = list(blocks.get_block_ids()[0][first:last])
        skipped = int(params.get(SKIP_TOKENS, 0)) // self._block_size  # the staged file starts at this block
        self._pending_loads.append(_Transfer(str(params[KV_PATH]), ids, first_block=first - skipped))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KairosKVMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if not self._kv_transfer_config.is_kv_producer:
            return meta
        steps: dict[str, int] = {}  # watched request id -> tokens computed before this step
        for new in scheduler_output.scheduled_new_reqs:
            params = (new.sampling_params.extra_args or {}).get("kv_transfer_params") if new.sampling_params else None
            if params and params.get(REMOTE_DECODE):
                prompt_tokens = len(new.prompt_token_ids or ())
                # whole blocks before the prompt's last token, which the decode node computes itself
                skip = min(int(params.get(SKIP_TOKENS) or 0), prompt_tokens - 1) // self._block_size
                self._watched[new.req_id] = _Watched(prompt_tokens, list(new.block_ids[0]), max(0, skip))
                steps[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._watched:
                continue
            blocks = self._watched[req_id].block_ids
            if req_id in cached.resumed_req_ids:  # after a preemption the request has all new blocks
                blocks.clear()
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                blocks.extend(new_blocks[0])
            steps[req_id] = cached.num_computed_tokens[i]
        for req_id, computed in steps.items():
            watched = self._watched[req_id]
            prompt_len = watched.prompt_tokens
            if computed < prompt_len <= computed + scheduler_output.num_scheduled_tokens.get(req_id, 0):
                # the step that computes the prompt's last chunk: stage the blocks the prompt fills, but those
                # the decode node holds
                prompt_blocks = watched.block_ids[watched.skip_blocks : -(-prompt_len // self._block_size)]
                meta.saves.append(_Transfer(self._staged_path(req_id), prompt_blocks, req_id))
                self._staging.add(req_id)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._local_hits.pop(request.request_id, None)
        watched = self._watched.pop(request.request_id, None)
        if watched is None:
            return False, None
        staged = request.request_id in self._staging
        self._staging.discard(request.request_id)
        # Saves are synchronous: the staged copy is whole, so the blocks can be freed now. Held, the worker
        # frees them once the decode node has the KV; a request aborted before its KV was staged has nothing
        # to wait for.
        path = self._staged_path(request.request_id)
        skipped = watched.skip_blocks * self._block_size
        return self._hold and staged, {KV_PATH: path, KV_TOKENS: request.num_prompt_tokens, SKIP_TOKENS: skipped}

    # ---- worker side ----------------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KairosKVMetadata)
        for load in meta.loads:
            path = rank_path(load.path, _tp_rank())
            try:
                with open_private(path, "rb") as f:
                    staged = torch.load(f, map_location="cpu", weights_only=True)
                for name, layer in forward_context.no_compile_layers.items():
                    kv = getattr(layer, "kv_cache", None)
                    if not isinstance(kv, torch.Tensor) or kv.numel() == 0:
                        continue
                    blocks = staged[name]
                    dim = _block_dim(kv, self._num_blocks)
                    count = len(load.block_ids)
                    if blocks.shape[dim] < load.first_block + count:
                        raise ValueError(f"{blocks.shape[dim]} staged blocks, {load.first_block + count} needed")
                    index = torch.tensor(load.block_ids, dtype=torch.long, device=kv.device)
                    staged_blocks = blocks.narrow(dim, load.first_block, count)
                    kv.index_copy_(dim, index, staged_blocks.to(kv.device, kv.dtype))
            except (OSError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError) as error:
                # a file gone, short, of another shape or corrupt: vLLM recomputes the blocks
                logger.warning(
                    "KV load from %s failed (%s); its %d blocks are recomputed", path, error, len(load.block_ids)
                )
                self._failed_blocks.update(load.block_ids)
            except Exception:  # unexpected: still recomputed (the engine must go on), but with its traceback
                logger.exception("KV load from %s failed; its %d blocks are recomputed", path, len(load.block_ids))
                self._failed_blocks.update(load.block_ids)
            with contextlib.suppress(OSError):
                os.unlink(path)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KairosKVMetadata)
        for save in meta.saves:
            dim = _block_dim(kv_layer, self._num_blocks)
            index = torch.tensor(save.block_ids, dtype=torch.long, device=kv_layer.device)
            self._saving.setdefault(save.path, {})[layer_name] = kv_layer.index_select(dim, index).cpu()

    def wait_for_save(self) -> None:
        saving, self._saving = self._saving, {}
        meta = self._get_connector_metadata()
        assert isinstance(meta, KairosKVMetadata)
        requests = {save.path: save.req_id for save in meta.saves}
        rank = _tp_rank()
        for path, layers in saving.items():
            final = rank_path(path, rank)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(final + ".tmp")
            with open_private(final + ".tmp", "wb") as f:
                torch.save(layers, f)
            os.replace(final + ".tmp", final)  # a reader never sees half a file
            if self._hold:
                self._held[requests[path]] = (final, time.monotonic())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Held requests whose KV the decode node has (or held past ``hold_timeout_s``): free their blocks."""
        self._finished |= finished_req_ids & self._held.keys()
        now, taken = time.monotonic(), set()
        for req_id in self._finished:
            path, since = self._held[req_id]
            if os.path.exists(path + TAKEN) or now - since > self._hold_timeout_s:
                taken.add(req_id)
                with contextlib.suppress(OSError):
                    os.unlink(path + TAKEN)
        for req_id in taken:
            del self._held[req_id]
        self._finished -= taken
        return taken or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed
