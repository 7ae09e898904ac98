"""Our engine semantics against SGLang 0.5.23's own code (from its wheel), on the same logits.

Three levels, each over random cases built to hit the edges (block sizes 4, 8, 32; leftover prompt
tokens that do and do not fill a block; confidences on and near the threshold; exact ties; the mask
token as top-1; EOS; budget stops):

1. one step: ``engine.algorithms`` rules vs the SGLang classes' ``step`` (tokens, done flags, state);
2. one block: SGLang's ``DllmAlgorithm._run_sync`` loop (its forward count is the model runner's
   call count) vs our decoder, driven by the same input-dependent logits;
3. layout: ``ReqDllmMixin`` (phases, fill ids, prompt mask) vs ``engine.layout``.

Skipped with a reason when the wheel's source is absent (``python scripts/fetch_sglang.py``).
"""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import torch

import sglang_reference
from dwise_predict.engine import block_layout, prefill_rounds
from dwise_predict.engine.algorithms import AlgorithmConfig, make_rule
from dwise_predict.engine.reference import MIRRORED, mirrored_problems

MASK = 5
V = 12
DELETE, SPLIT = 10, 11  # JointThresholdInDel's edit tokens (a model declares them in its config)
ALGORITHM_PARAMS = {
    "LowConfidence": [{}, {"threshold": 0.5}, {"threshold": 0.3}, {"threshold": 1.0}],
    "JointThreshold": [{}, {"threshold": 0.7, "edit_threshold": 0.5}, {"max_post_edit_steps": 2, "threshold": 1.0},
                       {"penalty_lambda": 1.5, "edit_threshold": 0.2}, {"max_post_edit_steps": 0},
                       # SGLang's batched step (the NPU default): an execution switch that we drop, so
                       # SGLang's vectorized path must decide exactly as our rule does
                       {"vectorized_decoding": True, "max_post_edit_steps": 2, "edit_threshold": 0.3}],
    "JointThresholdInDel": [{}, {"threshold": 0.7, "edit_threshold": 0.5}, {"max_post_edit_steps": 2},
                            {"max_post_edit_steps": 0, "threshold": 1.0}],
}


def our_rule(name, params):
    rule = make_rule(name, MASK, AlgorithmConfig.from_mapping(params).params)
    rule.bind(OracleModel)
    return rule


class OracleModel:
    """What a rule may read of the model: vocabulary size and edit tokens."""

    vocab_size, delete_token_id, split_token_id = V, DELETE, SPLIT


@pytest.fixture(scope="module")
def sgl():
    return sglang_reference.load()


def random_logits(gen: torch.Generator, rows: int, block: int) -> torch.Tensor:
    """Logits with coarse steps (exact ties), sometimes a peaked top-1, sometimes the mask on top."""
    logits = torch.randint(-4, 5, (rows, block, V), generator=gen).float() * 0.5
    peak = torch.rand(rows, block, generator=gen) < 0.5
    logits += peak[..., None] * torch.zeros(rows, block, V).scatter_(
        2, torch.randint(0, V, (rows, block, 1), generator=gen), torch.rand(rows, block, 1, generator=gen) * 8)
    mask_top = torch.rand(rows, block, generator=gen) < 0.05
    logits[..., MASK] = torch.where(mask_top, logits.max(-1).values + 1, logits[..., MASK])
    # confidences exactly on a threshold: a two-way tie (p = 0.5) and a saturated peak (p = 1.0)
    kind = torch.rand(rows, block, generator=gen)
    two = torch.randint(0, V, (rows, block, 2), generator=gen)
    tie = torch.full((rows, block, V), float("-inf")).scatter_(2, two, 0.0)
    tie[..., 0] = torch.where(two[..., 0] == two[..., 1], 0.0, tie[..., 0])  # keep a second finite token
    peak = torch.zeros(rows, block, V).scatter_(2, two[..., :1], 60.0)
    logits = torch.where((kind < 0.1)[..., None], tie, logits)
    return torch.where(((kind >= 0.1) & (kind < 0.15))[..., None], peak, logits)


def random_blocks(gen: torch.Generator, rows: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input blocks mid-decoding: leftover prompt (prompt mask), some filled positions, the rest masked."""
    leftover = torch.randint(0, block, (rows,), generator=gen)
    prompt_mask = torch.arange(block)[None, :] < leftover[:, None]
    ids = torch.randint(0, V, (rows, block), generator=gen)
    ids[ids == MASK] = 0
    masked = (torch.rand(rows, block, generator=gen) < torch.rand(rows, 1, generator=gen)) & ~prompt_mask
    return torch.where(masked, torch.full_like(ids, MASK), ids), prompt_mask


@pytest.mark.parametrize("name", list(ALGORITHM_PARAMS))
@pytest.mark.parametrize("block", [4, 8, 32])
def test_one_step_matches_sglang(sgl, name, block):
    """>= 1,000 rows per algorithm and block size, several steps each: identical tokens, done, state."""
    gen = torch.Generator().manual_seed(block)
    cases = 0
    for params in ALGORITHM_PARAMS[name]:
        ref = sglang_reference.make_algorithm(sgl, name, block, MASK, params, DELETE, SPLIT)
        ours = our_rule(name, params)
        rows = 64
        ids, prompt_mask = random_blocks(gen, rows, block)
        batch = sgl.ForwardBatch(rows, ids.reshape(-1).clone(), dllm_prompt_mask=prompt_mask)
        ref_states = ref.init_step_state(batch)
        state = ours.new_state(rows, ids.device)
        slots = torch.arange(rows)
        ours.start_block(state, slots)
        for _ in range(6):  # successive steps carry JointThreshold's post-edit budget and finished flag
            logits = random_logits(gen, rows, block)
            ref_done = ref.step(batch, logits.reshape(rows * block, V).clone(), ref_states)
            new, done = ours.step(ids, logits, prompt_mask, state, slots)
            assert torch.equal(new, batch.input_ids.view(rows, block)), (name, params)
            assert done.tolist() == list(ref_done), (name, params)
            ids = new
            cases += rows
    assert cases >= 1000


# ---- one whole request, block by block ----------------------------------------------------------

ORACLE_POOL = 8192  # blocks of logits the oracles pick from, per block width
_oracle_pools: dict[tuple[int, int], torch.Tensor] = {}


def oracle(seed: int, eos: int):
    """Input-dependent logits, the same function for SGLang's loop and ours: a stand-in model.

    Each (seed, context, block) picks one of :data:`ORACLE_POOL` blocks of :func:`random_logits`
    (with the ``eos`` logit moved up or down by up to 1.5), drawn once per block width and ``eos``,
    by a hash of the inputs (Python's hash of a tuple of ints is not salted: the same pick in every
    run), and hands it out as a copy. Drawing a block per call took more time than both loops."""

    def logits_for(block_ids: torch.Tensor, context: int) -> torch.Tensor:
        ids = block_ids.tolist()
        pool = _oracle_pools.get((len(ids), eos))
        if pool is None:
            gen = torch.Generator().manual_seed(len(ids))
            pool = _oracle_pools[len(ids), eos] = random_logits(gen, ORACLE_POOL, len(ids))
            pool[..., eos] += torch.rand(ORACLE_POOL, len(ids), generator=gen) * 3 - 1.5
        return pool[hash((seed, context, *ids)) % ORACLE_POOL].clone()
    return logits_for


def new_request(sgl, config, prompt, cached_prefix=0, budget=1, eos=2):
    """A request carrying SGLang's ``ReqDllmMixin`` (the engine's per-request dLLM state) and
    ``Req``'s finish rule (``update_finish_state``), with ``max_new_tokens = budget``; ``eos``: the
    stop id, or a set of them."""

    class Req(sgl.req.ReqDllmMixin, sgl.finish.ReqFinishMixin):
        pass

    req = Req()
    req.origin_input_ids, req.output_ids = array("q", prompt), array("q")
    req.prefix_len, req.dllm_initialized = cached_prefix, False
    req.init_diffusion_llm(config)
    sglang_reference.init_finish_state(req, budget, eos if isinstance(eos, set) else {eos})
    return req


def next_round(req, prefix_len: int) -> None:
    """The dLLM part of ``Req.init_next_round_input``: fill ids, the matched prefix, the phase."""
    req._init_fill_ids_for_dllm()
    req.prefix_len = prefix_len
    req._update_block_offset_for_dllm()
    req.determine_dllm_phase()


def sglang_request(sgl, name, params, prompt, budget, block, eos, logits_for, mask_id=MASK):
    """One request through SGLang's own code: ``ReqDllmMixin`` lays it out and decides its phase each
    round, the adder extends it by one block per forward (``_get_dllm_extend_len``), the algorithm's
    ``_run_sync`` runs each output block (the runner counts forwards), and ``Req.update_finish_state``
    (what ``SchedulerDllmMixin`` calls after appending a block) ends it. The output is what the
    client receives (``finished_len`` tokens), less the EOS itself, as traces count it."""
    config = sgl.DllmConfig(algorithm=name, algorithm_config=dict(params), block_size=block, mask_id=mask_id,
                            max_running_requests=1, delete_token_id=DELETE, split_token_id=SPLIT)
    algorithm = sgl.algorithms[name](config)
    req = new_request(sgl, config, prompt, budget=budget, eos=eos)
    kv_len, prefill, rounds = 0, 0, []
    while True:
        next_round(req, kv_len)
        if req.is_dllm_prefill():
            prefill += 1
            kv_len += block
            continue
        canvas = torch.tensor(list(req.full_untruncated_fill_ids[kv_len:kv_len + block]))
        runner = sgl.ModelRunner(lambda ids, _n, context=kv_len: logits_for(ids, context))
        _, tokens, *_ = algorithm._run_sync(runner, sgl.ForwardBatch(1, canvas.clone()))
        rounds.append(runner.forwards)
        new = tokens[0].tolist()
        req.output_ids.extend(new)
        req.update_finish_state(new_accepted_len=len(new))
        kv_len += block
        if isinstance(req.finished_reason, sgl.finish.FINISH_MATCHED_TOKEN):
            return prefill, rounds, list(req.output_ids)[:req.finished_len - 1], "eos"
        if isinstance(req.finished_reason, sgl.finish.FINISH_LENGTH):
            return prefill, rounds, list(req.output_ids)[:req.finished_len], "budget"
        assert req.finished_reason is None, req.finished_reason


class PerRequestOracle(OracleModel):
    """A ``BlockBackend`` answering each row with its request's oracle logits for its current block."""

    name = "oracle"
    mask_token_id, eos_token_ids, pad_token_id = MASK, (2,), 0
    hidden_size, max_context, tokenizer = 4, 4096, None
    device = torch.device("cpu")

    def __init__(self, block, oracles, requests):
        self.block_size, self.oracles = block, oracles
        self.queue = [r.request_id for r in requests]  # slots are refilled in request order

    def fingerprint(self):
        return {"name": self.name}

    def allocate(self, n_slots):
        self.committed = [0] * n_slots
        self.owner = [None] * n_slots

    def reset_slot(self, slot):
        self.committed[slot] = 0
        self.owner[slot] = self.queue.pop(0)

    def step(self, batch):
        from dwise_predict.collectors.backends.base import StepOutput

        n, window = len(batch.slots), batch.window
        logits = torch.zeros(n, window, V)
        for r, slot in enumerate(batch.slots.tolist()):
            start, commit = int(batch.out_start[r]), int(batch.commit_len[r])
            context = self.committed[slot] + start
            if commit != int(batch.n_valid[r]):  # a denoising row (perhaps carrying a commit)
                logits[r] = self.oracles[self.owner[slot]](batch.input_ids[r, start:start + window], context)
            self.committed[slot] += commit
        return StepOutput(logits=logits, hidden=torch.zeros(n, window, self.hidden_size))


@pytest.mark.parametrize("name", list(ALGORITHM_PARAMS))
def test_whole_requests_match_sglang(sgl, name):
    """>= 1,000 requests per algorithm: prefill forwards, forwards per block, output tokens and finish
    reason equal SGLang's, request by request, decoded 16 at a time with slot refill (SGLang's loop
    runs one request alone: batching changes nothing; as the queue drains the last rounds hold a
    single row, a batch of one). The cases reach EOS stops, budget stops, insert/delete edits and the
    engine's step cap."""
    from dwise_predict.collectors.decoder import decode
    from dwise_predict.collectors.records import DecodeRequest, DecodingConfig

    rng = np.random.default_rng(7)
    cases, finishes, capped, drained_alone = 0, set(), 0, 0
    per_group = -(-1000 // (3 * len(ALGORITHM_PARAMS[name])))
    for block in (4, 8, 32):
        for params in ALGORITHM_PARAMS[name]:
            requests, want, oracles = [], {}, {}
            for case in range(per_group):
                n = int(rng.choice([1, block - 1, block, block + 1, 2 * block, int(rng.integers(1, 3 * block))]))
                prompt = [int(t) for t in rng.integers(6, V, n)]
                budget = int(rng.integers(1, 4 * block))
                requests.append(DecodeRequest(f"r{case}", prompt, budget))
                oracles[f"r{case}"] = oracle(case, eos=2)
                want[f"r{case}"] = sglang_request(sgl, name, params, prompt, budget, block, 2, oracles[f"r{case}"])
            backend = PerRequestOracle(block, oracles, requests)
            config = DecodingConfig(algorithm=name, algorithm_config=params, block_size=block, batch_size=16)
            last_rounds = []
            for got in decode(backend, requests, config):
                assert (got.prompt_blocks, got.rounds_per_block, got.output_ids, got.finish) == \
                    want[got.request_id], (block, params, got.request_id)
                last_rounds.append(got.extra["finish_round"])
            drained_alone += sorted(last_rounds)[-1] > sorted(last_rounds)[-2]  # its last rounds ran one row
            cases += len(requests)
            finishes |= {w[3] for w in want.values()}
            max_forwards = our_rule(name, params).max_steps(block) + 1
            capped += sum(r == max_forwards for w in want.values() for r in w[1])
    assert cases >= 1000 and drained_alone > 0
    assert finishes == {"eos", "budget"}
    # JointThresholdInDel's final cleanup always ends a block inside the cap; the others can reach it
    assert capped > 0 or name == "JointThresholdInDel"


def one_token_model(eos_at: int, token: int = 7, stop: int = 2):
    """Logits that fill every position of a block at once: ``token``, and the id ``stop`` at ``eos_at``."""
    def logits_for(block_ids: torch.Tensor, context: int) -> torch.Tensor:
        logits = torch.zeros(len(block_ids), V)
        logits[:, token] = 50.0
        logits[eos_at] = 0.0
        logits[eos_at, stop] = 50.0
        return logits
    return logits_for


@pytest.mark.parametrize("eos_at,finish,tokens,stop", [(1, "eos", 1, 2), (2, "eos", 2, 2), (3, "budget", 3, 2),
                                                       (7, "budget", 3, 2), (1, "eos", 1, 4), (5, "budget", 3, 4)])
def test_an_eos_past_the_budget_is_a_length_finish(sgl, eos_at, finish, tokens, stop):
    """A block can run past ``max_new_tokens``: SGLang's ``update_finish_state`` takes an EOS inside
    the budget (finished length, EOS counted, <= budget) as a stop, and demotes one past it to a
    length finish cut at the budget (``_cap_finished_len_at_max_new_tokens``). Budget 3, block 8;
    the model stops on ids 2 and 4 (any of them ends a request)."""
    from dwise_predict.collectors.decoder import decode
    from dwise_predict.collectors.records import DecodeRequest, DecodingConfig

    request = DecodeRequest("r", [8] * 8, 3)  # one full prompt block: the first output block emits 8 tokens
    model = one_token_model(eos_at, stop=stop)
    want = sglang_request(sgl, "LowConfidence", {}, request.prompt_ids, request.budget, 8, {2, 4}, model)
    assert want == (1, [2], [7] * tokens, finish)  # SGLang's verdict, as this test's name says
    backend = PerRequestOracle(8, {"r": model}, [request])
    backend.eos_token_ids = (2, 4)
    got = next(iter(decode(backend, [request], DecodingConfig(algorithm="LowConfidence", block_size=8, batch_size=1))))
    assert (got.prompt_blocks, got.rounds_per_block, got.output_ids, got.finish) == want


# ---- layout -------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [4, 8, 32])
def test_layout_matches_req_mixin(sgl, block):
    """Prefill forwards (with cached prefixes), the block each one runs (the serving hook keys its
    prompt rows by ``prefix_len + block``), leftover tokens under the prompt mask, first outputs."""
    config = sgl.DllmConfig(algorithm="LowConfidence", algorithm_config={}, block_size=block, mask_id=MASK,
                            max_running_requests=1)
    for n in range(1, 4 * block + 2):
        prompt = [1000 + i for i in range(n)]
        for cached in range(0, n // block + 1):
            req = new_request(sgl, config, prompt)
            kv_len, forwards = cached * block, 0
            next_round(req, kv_len)
            while req.is_dllm_prefill():
                forwards += 1
                assert list(req.full_untruncated_fill_ids[kv_len:kv_len + block]) == prompt[kv_len:kv_len + block]
                kv_len += block
                next_round(req, kv_len)
            layout = block_layout(n, block)
            assert kv_len == layout.prompt_blocks * block
            assert forwards == prefill_rounds(n, block, cached_prefix=cached * block), (n, cached)
            assert list(req.full_untruncated_fill_ids[kv_len:kv_len + block]) == (
                prompt[kv_len:] + [MASK] * layout.first_block_outputs)


def test_mirrored_names_exist_in_the_wheel(sgl):
    """Every SGLang class, attribute and default we mirror is in the wheel, with the value we use."""
    assert MIRRORED, "the list of mirrored names is empty"
    assert mirrored_problems(lambda name, block: sglang_reference.make_algorithm(sgl, name, block, MASK, None, DELETE,
                                                                                SPLIT)) == []


def test_real_checkpoints_get_the_block_size_and_mask_id_sglang_serves_them_with():
    """``DllmConfig.from_server_args`` holds a table of architectures (its ``DLLM_PARAMS``) whose
    block size and mask id override the checkpoint's config.json; the block loop uses the same."""
    import ast

    from dwise_predict.collectors.backends.block_loop import SGLANG_DLLM_PARAMS

    if not sglang_reference.available():
        pytest.skip(sglang_reference.SKIP_REASON)
    path = sglang_reference.source_root() / "sglang" / "srt" / "dllm" / "config.py"
    table = next(node.value for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "DLLM_PARAMS" for t in node.targets))
    sglang = {}
    for key, value in zip(table.keys, table.values):
        entry = {k.value: v.value for k, v in zip(value.keys, value.values) if isinstance(v, ast.Constant)}
        if isinstance(entry.get("block_size"), int) and entry.get("mask_id", -1) >= 0:  # a mask-token model
            sglang[key.value] = {"block_size": entry["block_size"], "mask_id": entry["mask_id"]}
    assert SGLANG_DLLM_PARAMS == sglang and len(sglang) == 3


def sglang_dllm_config(monkeypatch, checkpoint: dict, algorithm: str, config_path):
    """SGLang's own ``DllmConfig.from_server_args`` for a server given ``--dllm-algorithm algorithm
    --dllm-algorithm-config config_path``, its model config stood in by ``checkpoint`` (config.json)."""
    import sys
    from types import SimpleNamespace

    module = sys.modules["sglang.srt.dllm.config"]
    model_config = SimpleNamespace(hf_config=SimpleNamespace(**checkpoint), vocab_size=200_000)
    monkeypatch.setattr(module, "resolving_view", lambda args: args)
    monkeypatch.setattr(module, "ModelConfig", SimpleNamespace(from_server_args=lambda *a, **k: model_config))
    return module.DllmConfig.from_server_args(SimpleNamespace(
        dllm_algorithm=algorithm, dllm_algorithm_config=str(config_path), model_path="m", revision=None,
        max_running_requests=None, dllm_fdfo=False))


@pytest.mark.parametrize("name,text", [
    ("LowConfidence", "threshold: 0.9\n"),
    ("JointThreshold", "threshold: 0.7\nedit_threshold: 0.3\nblock_size: 16\nvectorized_decoding: true\n"
                       "capture_input_preparation: false\n"),
    ("JointThresholdInDel", "max_post_edit_steps: 4\nblock_size: 4\n"),
])
def test_the_servers_algorithm_config_file_reads_as_sglang_reads_it(sgl, tmp_path, monkeypatch, name, text):
    """One ``--dllm-algorithm-config`` YAML file, read by SGLang's own ``DllmConfig.from_server_args``
    (its model config stood in: an SDAR checkpoint) and by ``collect --algorithm-config``: the same
    block size, and the algorithm SGLang builds from it holds our rule's parameters; the serving hook's
    reading of SGLang's ``DllmConfig`` (``served_decoding``) records the same."""
    from dwise_predict.collectors.records import DecodingConfig
    from dwise_predict.engine.algorithms import read_algorithm_file, served_decoding
    from dwise_predict.engine.reference import ATTRIBUTES

    path = tmp_path / "algorithm.yaml"
    path.write_text(text)
    theirs = sglang_dllm_config(monkeypatch, {"architectures": ["SDARForCausalLM"], "delete_token_id": DELETE,
                                              "split_token_id": SPLIT}, name, path)
    algorithm = sgl.algorithms[name](theirs)

    ours = DecodingConfig(algorithm=name, algorithm_config=read_algorithm_file(str(path)))
    assert ours.block_size in (None, theirs.block_size) and (ours.block_size is None) == ("block_size" not in text)
    rule = make_rule(name, theirs.mask_id, ours.algorithm_config)
    for attribute, param in ATTRIBUTES[name].items():
        assert getattr(algorithm, attribute) == rule.params[param], attribute
    assert algorithm.max_steps(theirs.block_size) == rule.max_steps(theirs.block_size)
    assert served_decoding(theirs.algorithm, theirs.algorithm_config, theirs.block_size) == {
        "algorithm": name, "algorithm_config": rule.params, "block_size": theirs.block_size}
    if name == "JointThreshold":  # SGLang took the file's execution switch; it decides nothing
        assert algorithm.vectorized_decoding is True and "vectorized_decoding" not in ours.algorithm_config


@pytest.mark.parametrize("expert_capacity", [None, 8])
@pytest.mark.parametrize("checkpoint_block", [4, 32, None])
@pytest.mark.parametrize("served_block", [4, 32])
def test_a_checkpoint_routed_per_block_is_served_only_at_its_own_block_size(sgl, tmp_path, monkeypatch,
                                                                          expert_capacity, checkpoint_block,
                                                                          served_block):
    """SGLang's ``DllmConfig.from_server_args`` (its model config stood in) refuses what
    ``routing_block_size_problem`` refuses, and nothing else, for an SDAR checkpoint served at its
    table's block size (4) or at an algorithm config's ``block_size``."""
    from dwise_predict.engine.layout import routing_block_size_problem

    path = tmp_path / "algorithm.yaml"
    path.write_text(f"block_size: {served_block}\n" if served_block != 4 else "")
    checkpoint = {"architectures": ["SDARForCausalLM"], "block_size": checkpoint_block, "expert_capacity": expert_capacity}
    try:
        config = sglang_dllm_config(monkeypatch, checkpoint, "LowConfidence", path)
    except ValueError as err:
        assert "block routing" in str(err), err
        refused = True
    else:
        assert config.block_size == served_block
        refused = False
    assert (routing_block_size_problem(checkpoint, served_block) is not None) == refused
    assert refused == (expert_capacity is not None and checkpoint_block != served_block)


def test_a_tokenizer_stops_requests_on_the_ids_sglang_attaches_to_it():
    """SGLang's ``attach_additional_stop_token_ids`` (with its table of turn-final markers), run from
    its source on a tokenizer stand-in, finds the ids ``tokenizer_stop_ids`` finds, beside the eos."""
    import ast

    from dwise_predict.engine import tokenizer_stop_ids

    if not sglang_reference.available():
        pytest.skip(sglang_reference.SKIP_REASON)
    path = sglang_reference.source_root() / "sglang" / "srt" / "utils" / "hf_transformers" / "common.py"
    wanted = {"_ADDITIONAL_STOP_TOKEN_TEXTS", "attach_additional_stop_token_ids"}
    nodes = [node for node in ast.parse(path.read_text()).body
             if getattr(node, "name", None) in wanted
             or any(getattr(target, "id", None) in wanted for target in getattr(node, "targets", ()))]
    assert len(nodes) == 2, "SGLang moved its additional stop tokens"
    sglang = {}
    exec(compile(ast.Module(nodes, type_ignores=[]), str(path), "exec"), sglang)

    markers = {text: 100 + i for i, text in enumerate(sglang["_ADDITIONAL_STOP_TOKEN_TEXTS"])}

    class Tokenizer:  # every marker SGLang knows, and an added token that is none of them
        eos_token_id = 2

        def get_added_vocab(self):
            return {**markers, "<|other|>": 11}

    attached = Tokenizer()
    sglang["attach_additional_stop_token_ids"](attached)
    assert attached.additional_stop_token_ids == set(markers.values()) and len(markers) >= 3
    assert tokenizer_stop_ids(Tokenizer()) == {2, *markers.values()}
    assert tokenizer_stop_ids(attached) == {2, *markers.values()}  # SGLang's own tokenizer: its attached ids
    Tokenizer.get_added_vocab = lambda self: {}
    bare = Tokenizer()
    sglang["attach_additional_stop_token_ids"](bare)
    assert bare.additional_stop_token_ids is None and tokenizer_stop_ids(bare) == tokenizer_stop_ids(Tokenizer()) == {2}


# ---- the tiny dLLM's traces, re-decoded by SGLang's own loop on the same model ------------------

class TinyRunner:
    """The tiny dLLM behind SGLang's model-runner interface, one request: prefills the full prompt
    blocks on first use, keeps each finished block (the input of its block's last forward) and
    commits it in front of the next block's first forward, as the decoder's backend does."""

    def __init__(self, backend, prompt: list[int], block: int):
        from dwise_predict.collectors.backends.base import StepBatch

        self.backend, self.block, self.batch = backend, block, StepBatch
        self.prompt, self.context, self.last = prompt, None, None
        backend.allocate(1)
        backend.reset_slot(0)

    def _step(self, ids, commit, out_start):
        t = lambda v: torch.tensor([v])  # noqa: E731
        return self.backend.step(self.batch(slots=t(0), input_ids=ids[None], n_valid=t(len(ids)),
                                            commit_len=t(commit), out_start=t(out_start), window=self.block))

    def logits_for(self, ids: torch.Tensor, context: int) -> torch.Tensor:
        if self.context is None:
            for start in range(0, context, self.block):
                self._step(torch.tensor(self.prompt[start:start + self.block]), self.block, 0)
        elif context != self.context:  # a new block: the previous one rides along, committed
            out = self._step(torch.cat([self.last, ids]), self.block, self.block)
            self.context, self.last = context, ids
            return out.logits[0].float()
        self.context, self.last = context, ids
        return self._step(ids, 0, 0).logits[0].float()


@pytest.mark.parametrize("name,params", [("LowConfidence", {}), ("JointThreshold", {"threshold": 0.7})])
def test_tiny_model_traces_redecoded_by_sglang_give_the_same_rounds(sgl, name, params):
    """The shipped tiny dLLM's decoding, request by request, equals SGLang's own algorithm loop
    driving the same model: prefill forwards, forwards per block, tokens and finish reason."""
    from dwise_predict.collectors.backends import load_backend
    from dwise_predict.collectors.decoder import decode
    from dwise_predict.collectors.records import DecodeRequest, DecodingConfig
    from dwise_predict.collectors.workloads import load_workload

    backend = load_backend("tiny")
    block, mask, eos = backend.block_size, backend.mask_token_id, backend.eos_token_id
    requests = [DecodeRequest(r.request_id, backend.tokenizer.apply_chat_template(
        r.messages, add_generation_prompt=True, tokenize=True, return_dict=False), 40)
        for r in load_workload("tiny-default", seed=0, limit=24).requests]
    ours = {r.request_id: r for r in decode(backend, requests, DecodingConfig(
        algorithm=name, algorithm_config=params, batch_size=1))}
    for request in requests:
        runner = TinyRunner(backend, request.prompt_ids, block)
        want = sglang_request(sgl, name, params, request.prompt_ids, request.budget, block, eos,
                              runner.logits_for, mask_id=mask)
        got = ours[request.request_id]
        assert (got.prompt_blocks, got.rounds_per_block, got.output_ids, got.finish) == want, request.request_id
