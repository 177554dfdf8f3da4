#!/usr/bin/env python3
"""Generates the vLLM KV-event golden cases in ingest/tests/fixtures/vllm-events/ (committed).

Every payload is made by vLLM's own code, taken from vLLM's released wheels on PyPI (fetched with
`pip download --no-deps`, read from the zip, never installed):
- the event classes of `vllm/distributed/kv_events.py` (`BlockStored`, `BlockRemoved`,
  `AllBlocksCleared`, `KVEventBatch`), encoded with `msgspec.msgpack.Encoder()` as its
  `ZmqEventPublisher` does;
- block hashes from `vllm/utils/hashing.py` (sha256, sha256_cbor, xxhash), chained by
  `hash_block_tokens`, seeded by `init_none_hash`, with extra keys from
  `generate_block_hash_extra_keys` / `to_event_extra_keys` and the integer form from
  `maybe_convert_block_hash` (`vllm/v1/core/kv_cache_utils.py`; these functions are lifted out
  of the module with `ast` and run as they are, so no torch is needed).
Only the imports these never call (config, logger, network helpers) are stood in for.

The engines are small models of vLLM's prefix cache written here: full blocks, LRU eviction,
a removal per evicted block, a clear on restart (with a new hash seed), prefix-cache reuse
re-announced under `kv_cache_report_mode="full"`. What a case expects comes from them, not from
kvplane: after every batch, for every query, the blocks each engine would hit - the leading
blocks of the query, hashed as that engine hashes, that its cache holds (what vLLM's
`find_longest_cache_hit` finds) - and the number of blocks its GPU cache holds. Each batch also
records the events as vLLM itself decodes them (`msgspec.msgpack.decode(payload,
type=KVEventBatch)`, hashes in their integer form).

Needs: pip install msgspec pyzmq cbor2 xxhash
Run: python3 scripts/gen-vllm-fixtures.py
"""

import ast
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import types
import zipfile
from collections import OrderedDict

import msgspec

OUT = os.path.join(os.path.dirname(__file__), "..", "ingest", "tests", "fixtures", "vllm-events")
WHEELS = os.path.join(tempfile.gettempdir(), "kvplane-vllm-wheels")
BLOCK_SIZE = 4


def wheel(version):
    os.makedirs(WHEELS, exist_ok=True)
    for name in os.listdir(WHEELS):
        if name.startswith(f"vllm-{version}-") and name.endswith(".whl"):
            return os.path.join(WHEELS, name)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", WHEELS, f"vllm=={version}"],
        check=True,
    )
    return wheel(version)


def stub(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def strip_annotations(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
            for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
                a.annotation = None
            if node.args.vararg:
                node.args.vararg.annotation = None
            if node.args.kwarg:
                node.args.kwarg.annotation = None
        if isinstance(node, ast.AnnAssign):
            node.annotation = ast.Constant(None)
    return tree


class Vllm:
    """The parts of one vLLM release this generator runs."""

    def __init__(self, version):
        self.version = version
        zf = zipfile.ZipFile(wheel(version))
        read = lambda path: zf.read(path).decode()  # noqa: E731
        import logging

        stub("vllm")
        stub("vllm.config")
        stub("vllm.config.kv_events", KVEventsConfig=object)
        stub("vllm.logger", init_logger=logging.getLogger)
        stub("vllm.utils")
        stub(
            "vllm.utils.network_utils",
            get_ip=None, get_tcp_uri=None, is_valid_ipv6_address=None, split_zmq_path=None,
        )
        stub("vllm.v1")
        stub("vllm.v1.core")
        stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
        self.events = self._load(f"kvplane_vllm_{version.replace('.', '_')}_kv_events",
                                 read("vllm/distributed/kv_events.py"))
        self.hashing = self._load(f"kvplane_vllm_{version.replace('.', '_')}_hashing",
                                  read("vllm/utils/hashing.py"))
        self.utils_source = read("vllm/v1/core/kv_cache_utils.py")
        # A batch as a source tree that drops `array_like` sends it: a map.
        self.MapBatch = msgspec.defstruct(
            "KVEventBatch",
            [("ts", float), ("events", list[self.events.BlockStored | self.events.BlockRemoved
                                             | self.events.AllBlocksCleared]),
             ("data_parallel_rank", int | None, None)],
            omit_defaults=True,
        )
        self.encoder = msgspec.msgpack.Encoder()

    def _load(self, name, source):
        spec = importlib.util.spec_from_loader(name, loader=None)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        exec(compile(source, name, "exec"), module.__dict__)
        return module

    def hasher(self, algo, seed, int_hashes=True):
        return Hasher(self, algo, seed, int_hashes)

    def decode(self, payload):
        """The batch as vLLM decodes it, as plain values."""
        try:
            return msgspec.msgpack.decode(payload, type=self.events.KVEventBatch)
        except msgspec.ValidationError:
            return msgspec.msgpack.decode(payload, type=self.MapBatch)


FUNCTIONS = {
    "hash_block_tokens", "maybe_convert_block_hash", "init_none_hash", "resolve_none_hash_seed",
    "generate_block_hash_extra_keys", "_gen_mm_extra_hash_keys", "_gen_lora_extra_hash_keys",
    "_gen_prompt_embeds_extra_hash_keys", "to_event_extra_keys",
}
CONSTANTS = {
    "DEFAULT_NONE_HASH_SEED", "_NONE_HASH_SEED", "_NON_CRYPTO_HASH_FUNCTIONS", "_CBOR_HASH_FUNCTIONS",
}


class Hasher:
    """vLLM's block hashing for one engine process: its algorithm and its NONE_HASH seed."""

    def __init__(self, vllm, algo, seed, int_hashes):
        tree = ast.parse(vllm.utils_source)
        keep = []
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS:
                keep.append(node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id in CONSTANTS for t in targets):
                    keep.append(node)
        module = ast.fix_missing_locations(strip_annotations(ast.Module(body=keep, type_ignores=[])))
        import hashlib
        import logging

        self.ns = {
            "os": os, "hashlib": hashlib, "logger": logging.getLogger("vllm"),
            "BlockHash": bytes,
            "envs": types.SimpleNamespace(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=int_hashes),
            "xxhash": vllm.hashing.xxhash, "xxhash_cbor": vllm.hashing.xxhash_cbor,
            "sha256": vllm.hashing.sha256, "sha256_cbor": vllm.hashing.sha256_cbor,
            "get_mm_features_in_window": None, "tensor_data": None,
        }
        exec(compile(module, "kv_cache_utils", "exec"), self.ns)
        self.fn = vllm.hashing.get_hash_fn_by_name(algo)
        # Each engine is its own process: PYTHONHASHSEED makes its seed reproducible here.
        old = os.environ.get("PYTHONHASHSEED")
        os.environ["PYTHONHASHSEED"] = seed
        try:
            self.ns["init_none_hash"](self.fn)
        finally:
            if old is None:
                del os.environ["PYTHONHASHSEED"]
            else:
                os.environ["PYTHONHASHSEED"] = old

    def extra_keys(self, request, start):
        keys, _ = self.ns["generate_block_hash_extra_keys"](request, start, start + BLOCK_SIZE, 0)
        return keys

    def block_hashes(self, request):
        """The request's full-block hashes, as vLLM's request block hasher chains them."""
        out, parent = [], None
        for start in range(0, len(request.tokens) // BLOCK_SIZE * BLOCK_SIZE, BLOCK_SIZE):
            h = self.ns["hash_block_tokens"](
                self.fn, parent, request.tokens[start:start + BLOCK_SIZE],
                self.extra_keys(request, start),
            )
            out.append(h)
            parent = h
        return out

    def external(self, h):
        return self.ns["maybe_convert_block_hash"](h)

    def event_extra_keys(self, request, starts):
        keys = [self.extra_keys(request, s) for s in starts]
        if "to_event_extra_keys" in self.ns:
            return self.ns["to_event_extra_keys"](keys)
        return keys or None  # before 0.26 the hashing keys were published as they are


class Request:
    """What vLLM's block hashing reads of a request."""

    def __init__(self, tokens, lora=None, salt=None, session=None):
        self.tokens = list(tokens)
        self.lora_request = types.SimpleNamespace(
            lora_name=lora, name=lora, lora_path=f"/adapters/{lora}", adapter_id=7,
        ) if lora else None
        self.cache_salt = salt
        self.mm_features = []
        self.prompt_embeds = None
        self.session_id = session

    def json(self):
        return {"tokens": self.tokens, "lora_name": self.lora_request and self.lora_request.name,
                "cache_salt": self.cache_salt}


class Engine:
    """One engine rank's GPU prefix cache (full blocks, LRU) and the events vLLM emits for it."""

    def __init__(self, vllm, name, dp_rank, hasher, capacity, medium="GPU", int_hashes=True):
        self.vllm, self.name, self.dp_rank, self.hasher = vllm, name, dp_rank, hasher
        self.capacity, self.medium = capacity, medium
        self.cache = OrderedDict()  # vLLM's block hash -> None, least recently used first
        self.pending = []

    def serve(self, request, report_full=False):
        hashes = self.hasher.block_hashes(request)
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.cache:
            hit += 1
        if report_full and hit:
            # kv_cache_report_mode="full": reused prefix blocks are announced again.
            self.pending.append(self.stored(request, hashes, 0, hit, session=request.session_id))
        new = hashes[hit:]
        if new:
            self.evict(len(self.cache) + len(new) - self.capacity, keep=set(hashes))
            # Eviction takes leaves first (below), so a block past a miss is never cached: the
            # model holds one copy of a hash, as the engine does.
            assert not any(h in self.cache for h in new)
            self.pending.append(self.stored(request, hashes, hit, len(hashes),
                                            session=request.session_id))
        # vLLM frees a request's blocks tail first, so they are evicted tail first: each block
        # is used more recently than the blocks after it.
        for h in reversed(hashes):
            self.cache[h] = None
            self.cache.move_to_end(h)

    def stored(self, request, hashes, first, end, session=None, **extra):
        ev = self.vllm.events
        kwargs = dict(
            block_hashes=[self.hasher.external(h) for h in hashes[first:end]],
            parent_block_hash=self.hasher.external(hashes[first - 1]) if first else None,
            token_ids=request.tokens[first * BLOCK_SIZE:end * BLOCK_SIZE],
            block_size=BLOCK_SIZE,
            lora_id=request.lora_request.adapter_id if request.lora_request else None,
            medium=self.medium,
            lora_name=request.lora_request.name if request.lora_request else None,
            extra_keys=self.hasher.event_extra_keys(
                request, range(first * BLOCK_SIZE, end * BLOCK_SIZE, BLOCK_SIZE)),
        )
        if "session_id" in ev.BlockStored.__struct_fields__:
            kwargs["session_id"] = session
        kwargs.update(extra)
        return ev.BlockStored(**kwargs)

    def evict(self, n, keep=()):
        for h in [h for h in self.cache if h not in keep][:max(n, 0)]:
            del self.cache[h]
            self.pending.append(self.vllm.events.BlockRemoved(
                block_hashes=[self.hasher.external(h)], medium=self.medium))

    def restart(self, hasher):
        """A new engine process under the same name: empty cache, a new hash seed."""
        self.cache.clear()
        self.pending.append(self.vllm.events.AllBlocksCleared())
        self.hasher = hasher

    def hits(self, query):
        hashes = self.hasher.block_hashes(query)
        n = 0
        while n < len(hashes) and hashes[n] in self.cache:
            n += 1
        return n

    def step(self, ts, map_batch=False):
        """One scheduler step's batch, encoded as the publisher encodes it (None if empty)."""
        if not self.pending:
            return None
        cls = self.vllm.MapBatch if map_batch else self.vllm.events.KVEventBatch
        batch = cls(ts=ts, events=self.pending, data_parallel_rank=self.dp_rank)
        self.pending = []
        return self.vllm.encoder.encode(batch)


def as_plain(vllm, payload):
    """The batch as vLLM decodes it, with every hash in its integer form."""
    batch = vllm.decode(payload)
    plain = msgspec.to_builtins(batch)
    to_int = lambda h: int.from_bytes(h, "big") & ((1 << 64) - 1) if isinstance(h, bytes) else h  # noqa: E731,E501
    events = []
    for raw, ev in zip(batch.events, plain["events"] if isinstance(plain, dict) else plain[1]):
        d = {"type": type(raw).__name__}
        for field in raw.__struct_fields__:
            value = getattr(raw, field)
            if field == "block_hashes":
                value = [to_int(h) for h in value]
            elif field == "parent_block_hash" and value is not None:
                value = to_int(value)
            elif field == "extra_keys" and value is not None:
                value = msgspec.to_builtins(value)
            d[field] = value
        events.append(d)
    del ev
    return events


class Case:
    def __init__(self, name, vllm, description):
        self.name, self.vllm, self.description = name, vllm, description
        self.engines, self.queries, self.batches = [], [], []
        self.ts = 1_700_000_000.0
        self.dropped = {}

    def engine(self, name, seed, dp_rank=0, capacity=64, algo="sha256_cbor", int_hashes=True):
        e = Engine(self.vllm, name, dp_rank, self.vllm.hasher(algo, seed, int_hashes), capacity)
        self.engines.append(e)
        return e

    def step(self, engine, map_batch=False, notes=None, drops=None):
        self.ts += 0.01
        payload = engine.step(self.ts, map_batch)
        if payload is None:
            return
        for reason, n in (drops or {}).items():
            self.dropped[reason] = self.dropped.get(reason, 0) + n
        self.batches.append({
            "worker": engine.name,
            "dp_rank": engine.dp_rank,
            "payload": payload.hex(),
            "events": as_plain(self.vllm, payload),
            "requests": notes or [],
            "hits": {
                f"{e.name}/{e.dp_rank}": [e.hits(q) for q in self.queries] for e in self.engines
            },
            "gpu_blocks": sum(len(e.cache) for e in self.engines),
            "dropped": dict(sorted(self.dropped.items())),
        })

    def write(self):
        os.makedirs(OUT, exist_ok=True)
        doc = {
            "case": self.name,
            "description": self.description,
            "vllm": self.vllm.version,
            "generator": "scripts/gen-vllm-fixtures.py",
            "block_size": BLOCK_SIZE,
            "queries": [q.json() for q in self.queries],
            "batches": self.batches,
        }
        # One batch per line: diffs of a regenerated case stay readable.
        batches = doc.pop("batches")
        head = json.dumps(doc, indent=1)[:-2]
        with open(os.path.join(OUT, f"{self.name}.json"), "w") as f:
            f.write(head + ',\n "batches": [\n')
            f.write(",\n".join(json.dumps(b, separators=(",", ":")) for b in batches))
            f.write("\n ]\n}\n")


def tokens(rng, n):
    return [rng.randrange(1, 50_000) for _ in range(n)]


def chain_case(vllm, name, map_batch=False, algo="sha256_cbor", int_hashes=True):
    """One engine: stores, continuations, hits, evictions, a clear and a restart."""
    rng = random.Random(name)
    c = Case(name, vllm, "one engine: stores, continuations, prefix reuse, LRU evictions, "
             "a restart (clear, new seed)")
    e = c.engine("e0", "seed-e0", capacity=12, algo=algo, int_hashes=int_hashes)
    doc = tokens(rng, 6 * BLOCK_SIZE)
    c.queries = [Request(doc), Request(doc[:3 * BLOCK_SIZE] + tokens(rng, 9))]
    e.serve(Request(doc[:3 * BLOCK_SIZE]))
    c.step(e, map_batch)
    e.serve(Request(doc + tokens(rng, 2)))  # a continuation: its parent is the cached block 2
    c.step(e, map_batch)
    for _ in range(3):  # other prompts push the document out, block by block
        e.serve(Request(tokens(rng, 3 * BLOCK_SIZE)))
        c.step(e, map_batch)
    e.serve(Request(doc))
    c.step(e, map_batch)
    e.restart(vllm.hasher(algo, "seed-e0-restarted", int_hashes))
    e.serve(Request(doc[:2 * BLOCK_SIZE]))
    c.step(e, map_batch)
    c.write()


def hashes_case(vllm):
    """Byte hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0): sha256 (32 bytes), xxhash (16)."""
    rng = random.Random("bytes")
    c = Case("0.33-byte-hashes", vllm,
             "hashes sent as bytes: sha256 (32 bytes) and xxhash (16 bytes), one engine each")
    a = c.engine("e-sha256", "seed-a", algo="sha256", int_hashes=False)
    b = c.engine("e-xxhash", "seed-b", algo="xxhash", int_hashes=False)
    doc = tokens(rng, 5 * BLOCK_SIZE)
    c.queries = [Request(doc)]
    for e in (a, b):
        e.serve(Request(doc[:2 * BLOCK_SIZE]))
        c.step(e)
        e.serve(Request(doc))
        c.step(e)
    a.evict(1)
    c.step(a)
    c.write()


def tiers_case(vllm):
    """Copies in other tiers and offload placeholders never change what the GPU holds."""
    ev = vllm.events
    rng = random.Random("tiers")
    c = Case("0.33-tiers", vllm, "CPU, STORAGE, legacy FS and OBJ, REMOTE copies and CPU "
             "offload placeholders (block size 0, no tokens) beside the GPU cache")
    e = c.engine("e0", "seed-e0")
    doc = tokens(rng, 4 * BLOCK_SIZE)
    q = Request(doc)
    c.queries = [q]
    e.serve(q)
    c.step(e)
    hashes = [e.hasher.external(h) for h in e.hasher.block_hashes(q)]
    for medium in ("CPU", "STORAGE"):
        e.pending.append(e.stored(q, e.hasher.block_hashes(q), 0, 4, medium=medium))
    e.pending.append(e.stored(q, e.hasher.block_hashes(q), 0, 4, locality="REMOTE"))
    # An offload connector's placeholder store: no tokens, block size 0.
    e.pending.append(ev.BlockStored(block_hashes=hashes[:2], parent_block_hash=None, token_ids=[],
                                    block_size=0, lora_id=None, medium="CPU", lora_name=None))
    c.step(e)
    # FS and OBJ are STORAGE's older names; an engine sends one of them, so they take turns.
    for old, new in (("STORAGE", "FS"), ("FS", "OBJ")):
        e.pending.append(ev.BlockRemoved(block_hashes=hashes, medium=old))
        e.pending.append(e.stored(q, e.hasher.block_hashes(q), 0, 4, medium=new))
        c.step(e)
    for medium in ("CPU", "OBJ"):
        e.pending.append(ev.BlockRemoved(block_hashes=hashes, medium=medium))
    e.pending.append(ev.BlockRemoved(block_hashes=hashes, medium="GPU", locality="REMOTE"))
    c.step(e)
    e.evict(1)  # the GPU copy of the last block leaves, the other three are still hit
    c.step(e)
    c.write()


def hybrid_case(vllm):
    """A hybrid model: group 1 is a sliding window over the same block hashes."""
    ev = vllm.events
    rng = random.Random("hybrid")
    c = Case("0.33-hybrid-groups", vllm, "a hybrid model: the sliding-window group 1 stores and "
             "removes the same block hashes as the full-attention group 0")
    e = c.engine("e0", "seed-e0")
    q = Request(tokens(rng, 6 * BLOCK_SIZE))
    c.queries = [q]
    e.serve(q)
    # vLLM tags each store with its group; group 0 is full attention here.
    e.pending[-1].group_idx = None
    e.pending[-1].kv_cache_spec_kind = "full_attention"
    e.pending.append(e.stored(q, e.hasher.block_hashes(q), 0, 6, group_idx=1,
                              kv_cache_spec_kind="sliding_window",
                              kv_cache_spec_sliding_window=2 * BLOCK_SIZE))
    c.step(e)
    hashes = [e.hasher.external(h) for h in e.hasher.block_hashes(q)]
    # The window slides: group 1 frees its early blocks (its removals name only group_idx).
    e.pending.append(ev.BlockRemoved(block_hashes=hashes[:4], medium="GPU", group_idx=1))
    # Group 1 is not a prefix cache: its removal is ignored, and counted.
    c.step(e, drops={"non_primary_group": 1})
    e.evict(6)
    c.step(e)
    c.write()


def reuse_case(vllm):
    """kv_cache_report_mode="full": reused blocks re-announced, each evicted once."""
    rng = random.Random("reuse")
    c = Case("0.33-report-full", vllm, "kv_cache_report_mode=\"full\": prefix-cache hits are "
             "stored again (with the session that reused them), each block is evicted once")
    e = c.engine("e0", "seed-e0", capacity=8)
    system = tokens(rng, 3 * BLOCK_SIZE)
    c.queries = [Request(system)]
    for session in ("s1", "s2", "s3"):
        e.serve(Request(system + tokens(rng, BLOCK_SIZE + 1), session=session), report_full=True)
        c.step(e)
    for i in range(3):
        e.serve(Request(tokens(rng, 3 * BLOCK_SIZE), session=f"other-{i}"), report_full=True)
        c.step(e)
    c.write()


def partial_case(vllm):
    """Partial-block stores (a hash block size below the block size) are not full blocks."""
    rng = random.Random("partial")
    c = Case("0.33-partial-blocks", vllm, "a store whose block size is not the pool's (a "
             "partial block) is dropped and counted; the full blocks around it stay")
    e = c.engine("e0", "seed-e0")
    q = Request(tokens(rng, 3 * BLOCK_SIZE))
    c.queries = [q]
    e.serve(q)
    c.step(e)
    hashes = e.hasher.block_hashes(q)
    tail = Request(q.tokens + tokens(rng, BLOCK_SIZE // 2))
    partial = e.hasher.ns["hash_block_tokens"](e.hasher.fn, hashes[-1], tail.tokens[-2:], None)
    e.pending.append(vllm.events.BlockStored(
        block_hashes=[e.hasher.external(partial)], parent_block_hash=e.hasher.external(hashes[-1]),
        token_ids=tail.tokens[-2:], block_size=BLOCK_SIZE // 2, lora_id=None, medium="GPU",
        lora_name=None))
    c.step(e, drops={"block_size_mismatch": 1})
    # The full block replaces the partial one: its removal names a hash never indexed.
    e.pending.append(vllm.events.BlockRemoved(block_hashes=[e.hasher.external(partial)],
                                              medium="GPU"))
    c.step(e, drops={"remove_unknown": 1})
    c.write()


def fleet_case(vllm):
    """Random multi-engine streams: differing seeds, shared documents, LoRA, salts, restarts."""
    rng = random.Random("fleet")
    c = Case("0.33-fleet", vllm, "five engine ranks (one engine with two data-parallel ranks), "
             "each with its own hash seed, serving shared documents with and without LoRA and "
             "cache_salt; LRU evictions, restarts and report-full re-stores")
    engines = [c.engine(f"e{i}", f"seed-e{i}", capacity=40) for i in range(3)]
    engines.append(c.engine("e3", "seed-e3", dp_rank=0, capacity=40))
    engines.append(c.engine("e3", "seed-e3", dp_rank=1, capacity=40))
    docs = [tokens(rng, rng.randrange(2, 7) * BLOCK_SIZE) for _ in range(8)]
    keys = [(None, None), ("sql-lora", None), (None, "tenant-a"), ("sql-lora", "tenant-b")]
    c.queries = [Request(d + tokens(rng, BLOCK_SIZE), lora=lk, salt=sk)
                 for d in docs[:4] for lk, sk in keys]
    restarts = 0
    for step in range(120):
        e = rng.choice(engines)
        for _ in range(rng.randrange(1, 4)):
            lk, sk = rng.choice(keys)
            doc = rng.choice(docs)
            cut = rng.randrange(1, len(doc) // BLOCK_SIZE + 1) * BLOCK_SIZE
            e.serve(Request(doc[:cut] + tokens(rng, rng.randrange(0, 3 * BLOCK_SIZE)), lora=lk,
                            salt=sk, session=f"s{step}"), report_full=rng.random() < 0.2)
        if rng.random() < 0.03:
            restarts += 1
            e.restart(vllm.hasher("sha256_cbor", f"seed-{e.name}-{e.dp_rank}-r{restarts}"))
        c.step(e)
    c.write()


def main():
    current = Vllm("0.33.0")
    chain_case(current, "0.33-map-events")
    chain_case(current, "0.33-map-batch", map_batch=True)
    hashes_case(current)
    tiers_case(current)
    hybrid_case(current)
    reuse_case(current)
    partial_case(current)
    fleet_case(current)
    chain_case(Vllm("0.22.0"), "0.22-positional-events")
    print(f"wrote {len(os.listdir(OUT))} cases to {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
