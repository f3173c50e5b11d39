"""The speculative decoding loop: prefill, draft, verify, commit; greedy or lossless sampling, HF's processors per
node; stops exactly where HF generate() stops."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from ssmspec.hf import features
from ssmspec.speculate.adaptive import (
    COST_SIZES,
    Acceptance,
    Goodput,
    best_depth,
    chooses_packing,
    depth_gains,
    measure_cost,
    merge_curves,
)
from ssmspec.speculate.decoding import ColumnStreamer, Decoding
from ssmspec.speculate.drafters import Drafter
from ssmspec.speculate.generic import GenericRunner
from ssmspec.speculate.runner import ModelRunner
from ssmspec.speculate.verify import greedy_verify, sample_verify
from ssmspec.tree import TokenTree


@dataclass
class SpecStats:
    """Counters of one generate call (all rows together)."""

    verify_steps: int = 0
    accepted_tokens: int = 0  # drafted tokens accepted, summed over rows
    emitted_tokens: int = 0  # tokens appended to the outputs (accepted + bonus, after EOS/max truncation)
    tree_nodes_per_step: list[int] = field(default_factory=list)  # nodes per row verified, per step (max over rows)
    row_steps: int = 0  # verify steps counted per active row
    # emitted tokens whose top-2 logit gap was below near_tie_tolerance * max(1, |top logit|): where another
    # arithmetic (a tree vs one token, another kernel) may pick the other token in float32/bf16
    near_ties: int = 0
    near_tie_tolerance: float = 0.0
    max_verify_bytes: int = 0  # the largest verify step's buffers (records, node states, tree K/V), all rows
    out_of_memory: int = 0  # verify steps that ran out of memory and were retried with a smaller tree
    drafter: dict[str, float] = field(default_factory=dict)  # the drafter's own counters (Saguaro: hits, ...)

    @property
    def mean_accepted_per_step(self) -> float:
        """Tokens gained per verify step and row: accepted drafts + the bonus token."""
        return (self.accepted_tokens + self.row_steps) / max(self.row_steps, 1)


def eos_and_pad(generation_config) -> tuple[list[int], int]:
    """EOS ids as a list and the pad id, resolved as HF generate does (no pad token: the first EOS, else 0)."""
    eos = generation_config.eos_token_id
    eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    pad = generation_config.pad_token_id
    return eos, int(pad) if pad is not None else (eos[0] if eos else 0)


def speculative_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_ids: list[int],
    pad_token_id: int,
    drafter: Drafter,
    tree_budget: int,
    num_draft_tokens: int,
    commit: str = "replay",
    decode_single_nodes: bool | None = None,
    schedule: str = "constant",
    decoding: Decoding | None = None,
    static_shapes: bool = False,
    adaptive: bool = False,
    generic: bool = False,
    model_inputs: dict | None = None,
    verify_memory: int | None = None,
) -> tuple[torch.Tensor, SpecStats, ModelRunner | GenericRunner]:
    """Speculative decoding, greedy or (with `decoding.do_sample`) lossless sampling. Returns (sequences
    [B, L + T] as HF generate, stats, the target's runner holding the final committed cache); with
    `decoding.output_scores`/`output_logits` the per-token tensors are left in `decoding.scores`/`.logits`.

    Each step drafts at most `tree_budget` nodes per row, at most `num_draft_tokens` deep. `schedule`
    "heuristic" adapts the depth as HF's assisted generation does (+2 after a step that accepted every
    drafted token, -1 otherwise). Steps that verify one node per row use HF's own decode path (True) or
    the tree path (False); None: whichever the runner measured faster on this model (ModelRunner.single_node_path).
    `decoding` carries HF's logits
    processors (applied per node), stopping criteria (checked after every emitted token) and streamer.
    `static_shapes` pads trees to power-of-two node counts (or to the largest possible tree, where smaller) and
    commits fixed-length paths (the depth stays within `num_draft_tokens`, also under the heuristic schedule),
    so a compiled verify step never recompiles.
    `adaptive` picks each step's depth (0: plain decoding) for the best expected tokens per unit of cost
    (ssmspec.speculate.adaptive).
    `verify_memory` (bytes) cuts trees to the nodes per row whose verify buffers fit, as measured on earlier steps; a
    verify step that runs out of memory is retried with half the nodes (down to one) whatever the budget.
    `generic` verifies through HF's own forward (ssmspec.speculate.generic: chains, a batch row by row) instead of the
    seams; its prefill also takes `model_inputs` (a multimodal prompt's pixel values, grids, token types)."""
    dec = decoding if decoding is not None else Decoding()
    stats = SpecStats()
    b = input_ids.shape[0]
    wants_features = bool(getattr(drafter, "target_features", False))
    if wants_features and features.install(model) and getattr(model, "ssmspec_compile_call", None) is not None:
        # compiled before its LM head had the feature hook (a default call drafts with n-grams on a compiled model):
        # its graphs would never hand the features over, so the model is compiled anew, as it was
        args, kwargs = model.ssmspec_compile_call
        model.compile(*args, **kwargs)
    runner = (GenericRunner if generic else ModelRunner)(
        model, commit=commit, decode_single_nodes=decode_single_nodes, static_shapes=static_shapes,
        max_depth=num_draft_tokens, max_nodes=max(tree_budget, num_draft_tokens) + 1,
        capacity=max_new_tokens + max(tree_budget, num_draft_tokens) + 2,
    )  # fmt: skip
    stats.near_tie_tolerance = near_tie_tolerance(runner.dtype)
    # a drafter that drafts from the target's features (a draft head) gets the feature of every row's last
    # committed position after the prefill and before every later proposal (`_observe_features`)
    runner.capture_features = wants_features
    if max_new_tokens <= 0:
        return input_ids.clone(), stats, runner
    device = input_ids.device
    stream = ColumnStreamer(dec.streamer, input_ids, pad_token_id)
    topk = drafter.target_topk
    extra = {"model_inputs": model_inputs} if model_inputs else {}  # only the generic path takes them
    logits = runner.prefill(input_ids, attention_mask, all_positions=topk > 0, **extra)
    drafter.set_decoding(dec)
    drafter.start(input_ids, attention_mask)
    if wants_features:  # the prefill's last position
        _observe_features(drafter, (runner.features, [-1] * b, range(b)))
    mask = attention_mask.bool()
    prompts = input_ids.tolist()  # what HF's processors and criteria see: the padded prompt rows
    contexts = [input_ids[r][mask[r]].tolist() for r in range(b)]
    if topk:  # the target's top-k after every prompt token, for a drafter that recycles them
        ids_k, probs_k = _top(logits[:, -PROMPT_TOPK_POSITIONS:], topk)
        ids_k, probs_k = ids_k.tolist(), probs_k.tolist()
        offset = logits.shape[1] - len(ids_k[0])
        for r in range(b):
            real = mask[r, offset:].tolist()
            tokens = [t for t, m in zip(prompts[r][offset:], real) if m]
            drafter.observe_prompt(r, tokens, [(i, p) for i, p, m in zip(ids_k[r], probs_k[r], real) if m])
        logits = logits[:, -1]
    generated: list[list[int]] = [[] for _ in range(b)]
    pads = [0] * b  # pads a finished row has decoded since (only when scores are kept, as HF's loop does)
    done = [False] * b
    eos = set(eos_token_ids)
    keep = dec.keeps_scores
    stopping = len(dec.stopping) > 0
    kept: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(b)]  # (scores, raw) per position
    depth_limit = num_draft_tokens

    def ids(row: int) -> list[int]:
        return prompts[row] + generated[row] + [pad_token_id] * pads[row]

    def emit(row: int, toks: list[int]) -> int:
        """Append tokens until the row stops; returns how many were appended."""
        n = 0
        for t in toks:
            if done[row]:
                break
            generated[row].append(t)
            contexts[row].append(t)
            n += 1
            if t in eos or len(generated[row]) >= max_new_tokens or (stopping and dec.stops(ids(row), device)):
                done[row] = True
        stats.emitted_tokens += n
        return n

    raw = logits.float()  # HF processes and picks from float32 logits
    scores = dec.process([ids(r) for r in range(b)], raw, list(range(b)))
    first = dec.choose(scores).tolist()
    first_ties = [False] * b if dec.do_sample else _near_ties(logits, stats.near_tie_tolerance).tolist()
    for r in range(b):
        if keep:
            kept[r].append((scores[r], raw[r]))
        stats.near_ties += int(first_ties[r])
        emit(r, [first[r]])
    stream.release(generated, done)
    if adaptive or chooses_packing(runner):  # the cost curve also measures where packed linears pay, per size
        cost = cost_curve(model, runner)
    goodput = None
    if adaptive:
        # each level's acceptance starts from what the last call with this drafter and tree shape measured on this
        # model (kept on the model, as the cost curves are; a fresh model: 0.5); not when sampling, where a seed
        # draws the same tokens whatever ran before (the depths decide which random numbers are drawn)
        profiles = {} if dec.do_sample else model.__dict__.setdefault("_ssmspec_acceptance", {})
        profile_key = (_drafter_kind(drafter), tree_budget, num_draft_tokens)
        acceptance = Acceptance(b, prior=profiles.get(profile_key, 0.5))
        per_depth = max(1.0, tree_budget / max(num_draft_tokens, 1))
        # every step is timed: the cost of n nodes is the measured curve at the bucket n is padded to plus what a step
        # measured beyond its forward (drafting, bookkeeping), and speculation backs off where it measured slower
        # than plain decoding (Goodput)
        # sampling: a seed draws the same tokens on every run, so no decision follows this call's timing (which depths
        # are verified decides which random numbers are drawn): acceptance, the model's curve and a fixed overhead
        goodput = Goodput(cost, cost_seconds(model, runner), batch=b, measured=not dec.do_sample)
        # a drafter with calibrated per-node estimates sizes each tree itself; the engine then leaves depth and
        # budget at their maximum
        sized = drafter.size_by_goodput(lambda n: goodput.cost(runner.padded_size(n)))
        adaptive = not sized
    # a plain step (depth 0) drafts nothing: the drafter is not called (a drafter that prepares the next proposal
    # while the target verifies, Saguaro's, still is: its preparation follows every step)
    skips_drafter = type(drafter).ahead is Drafter.ahead
    node_cap: int | None = None  # nodes per row (root included) a verify step may have: memory (budget or OOM)
    bytes_per_node = 0.0  # verify buffers per row and node, as the largest step measured
    measured_nodes = 1  # the largest step's nodes per row whose buffers were measured
    shadow = None
    pending = None  # the target's features at the last step's commit, not yet handed to the drafter
    plain_steps = 0  # plain steps chosen in a row (low acceptance), and their shadow drafts' schedule
    next_shadow, shadows = 1, 0
    # seconds shadow drafts may still spend (SHADOW_SHARE of the plain steps' time), and what the last one took
    shadow_budget, shadow_cost = 0.0, 0.0
    reprice_at = 0  # the step from which the policy prices depths again (it pauses while far from speculating)
    try:
        while not all(done):
            started = time.perf_counter()
            remaining = [max_new_tokens - len(g) for g in generated]
            depth = min(depth_limit, max(remaining) - 1)
            done_before = list(done)
            shadow_seconds = 0.0
            # the heuristic schedule may go deeper than num_draft_tokens (as HF's): the budget grows with it, so a
            # chain's nodes follow its depth
            budget = tree_budget + max(0, depth - num_draft_tokens)
            shadow = None
            if goodput is not None and goodput.plain:
                depth = 0  # speculation measured slower than plain decoding: back off
            elif adaptive:
                if stats.verify_steps < reprice_at:
                    chosen = 0  # priced far from paying a few steps ago: acceptance moves slowly, plain until repriced
                else:
                    # the batch ends with its last row, and a row that finished early holds its slot idle until then,
                    # so a depth is priced by how much nearer it brings that end (`Acceptance.progress_survival`: each
                    # unfinished row by how far it is ahead of the row with the most left; at batch 8 on the embedded
                    # target, speculating for the mean row measured 0.94x HF greedy: the rows that accepted less
                    # finished 20 steps after the others)
                    unfinished = [r for r in range(b) if not done[r]]
                    most = max(remaining[r] for r in unfinished)
                    behind = [most - remaining[r] for r in unfinished]
                    rates = [acceptance.progress_survival(unfinished, behind, max(depth, 0))]
                    gains = depth_gains(rates, goodput.cost, max(depth, 0), per_depth,
                                        reruns=getattr(runner, "reruns", False))  # fmt: skip
                    chosen = best_depth(gains)
                    best = max(gains[1:], default=0.0)
                    if chosen == 0 and len(gains) > 1 and goodput.keeps_speculating(best):
                        chosen = best_depth(gains, 1)  # measured winning, a back-off's retry, or a first try
                    elif chosen == 0 and best < FAR_FROM_PAYING:  # (nothing measured could make it speculate)
                        reprice_at = stats.verify_steps + REPRICE_EVERY
                # plain decoding: the drafter's first level still tells how accurate it is now (a shadow draft costs a
                # drafting call: SHADOW_EVERY plain steps apart, twice as far after every SHADOW_EVERY of them in
                # a run of plain steps, up to SHADOW_MAX, and at most SHADOW_SHARE of the plain steps' time)
                if chosen == 0 and depth > 0:
                    plain_steps += 1
                    if plain_steps >= next_shadow and (shadow_budget >= shadow_cost or not goodput.measured):
                        t0 = time.perf_counter()
                        pending = _observe_features(drafter, pending)
                        shadow = drafter.propose(contexts, max(1, min(tree_budget, int(round(per_depth)))), 1)
                        shadow_seconds = time.perf_counter() - t0  # not part of the plain step's price
                        shadows += 1
                        reprice_at = 0  # its rates are news: priced again next step
                        next_shadow = plain_steps + min(SHADOW_MAX, SHADOW_EVERY * 2 ** (shadows // SHADOW_EVERY))
                elif chosen > 0:
                    plain_steps, next_shadow, shadows = 0, 1, 0
                depth, budget = chosen, max(1, min(tree_budget, int(round(per_depth * chosen))))
            if depth <= 0 and skips_drafter:
                proposed = [([int(c[-1])], [-1]) for c in contexts]
            else:
                pending = _observe_features(drafter, pending)
                proposed = drafter.propose(contexts, budget, max(depth, 0))
            drafts: list[tuple[list[int], list[int]]] = []
            qs: list[dict[int, torch.Tensor] | None] = []
            forced: dict[int, int] = {}  # finished rows decoding pads: row -> last node of its pad chain
            for r, d in enumerate(proposed):
                if done[r]:
                    k = min(max(depth, 0), max_new_tokens - len(kept[r]) - 1) if keep else -1
                    root = ids(r)[-1] if keep else contexts[r][-1]
                    drafts.append(([root] + [pad_token_id] * max(k, 0), list(range(-1, max(k, 0)))))
                    qs.append(None)
                    if k >= 0:
                        forced[r] = k
                    continue
                tokens, parents, index = _trim(d[0], d[1], remaining[r] - 1)
                drafts.append((tokens, parents))
                q = d[2] if len(d) > 2 else None
                qs.append({index[node]: dist for node, dist in q.items() if node in index} if q else None)
            if verify_memory is not None and bytes_per_node > 0:
                fits = max(1, int(verify_memory // (bytes_per_node * b)))
                node_cap = fits if node_cap is None else min(node_cap, fits)
            if node_cap is not None:
                drafts, qs = _cap(drafts, qs, forced, node_cap)
            if not skips_drafter:  # a drafter that prepares the next proposal now (Saguaro's)
                pending = _observe_features(drafter, pending)
            drafter.ahead(contexts, [None if done[r] else d for r, d in enumerate(drafts)], budget, max(depth, 0))
            while True:
                # built and prepared on the host, then one transfer (runner.prepare moves it to the model's device)
                tree = runner.prepare(TokenTree.from_lists([d[0] for d in drafts], [d[1] for d in drafts]))
                try:
                    node_logits = runner.verify(tree)
                    break
                except torch.OutOfMemoryError:
                    # nothing smaller than a plain decode step; the generic path's row-by-row forwards change
                    # HF's cache in place, so an interrupted one cannot be retried
                    if tree.num_nodes <= 1 or not isinstance(runner, ModelRunner):
                        raise
                    # the failed forward left nothing behind (the cache discards an interrupted verification)
                    stats.out_of_memory += 1
                    node_cap = max(1, max(len(d[0]) for d in drafts) // 2)
                    drafts, qs = _cap(drafts, qs, forced, node_cap)
            if tree.num_nodes > measured_nodes:
                # a verify's buffers grow with its nodes: measured where a step verifies more than any before (the
                # largest step holds the most; walking every record each step cost 0.07 ms of a 10 ms step)
                measured_nodes = tree.num_nodes
                held = runner.verify_bytes()
                stats.max_verify_bytes = max(stats.max_verify_bytes, held)
                bytes_per_node = held / (b * tree.num_nodes)
            if tree.origin is not None:
                qs = [{tree.index_of(r, n): v for n, v in q.items()} if q else None for r, q in enumerate(qs)]
            raw = node_logits.float()
            active = [not x for x in done]
            if dec.processes:
                scores = dec.score_tree(tree, raw, [ids(r) if active[r] or r in forced else None for r in range(b)])
            else:
                scores = raw
            tops = None
            if dec.do_sample:
                last, emitted = sample_verify(tree, scores, qs, dec.generator, active)
                ties_at = None  # near-ties only mean something for greedy choices: not computed when sampling
                if topk:
                    tops = [x.tolist() for x in _top(node_logits, topk)]
            else:
                # the step's one read from the device: every node's argmax and whether it is a near-tie (and the
                # target's top-k after every node, for a drafter that recycles them)
                ties_now = _near_ties(node_logits, stats.near_tie_tolerance).long()
                if topk:
                    ids_k, probs_k = _top(node_logits, topk)
                    picked = torch.cat([scores.argmax(-1)[..., None].double(), ties_now[..., None].double(),
                                        ids_k.double(), probs_k.double()], -1).tolist()  # [B][N][2 + 2k]  # fmt: skip
                    target = [[int(node[0]) for node in row] for row in picked]
                    ties_at = [[int(node[1]) for node in row] for row in picked]
                    tops = ([[[int(i) for i in node[2 : 2 + topk]] for node in row] for row in picked],
                            [[node[2 + topk :] for node in row] for row in picked])  # fmt: skip
                else:
                    target, ties_at = torch.stack([scores.argmax(-1), ties_now]).tolist()
                last, emitted = greedy_verify(tree, None, target=target)
            cut = last.tolist()  # per row, the last node to commit
            for r, k in forced.items():
                cut[r] = tree.index_of(r, k)
            path_list = [tree.path_nodes(r, node) for r, node in enumerate(cut)]
            ties = None if ties_at is None else [[ties_at[r][node] for node in p] for r, p in enumerate(path_list)]
            if tops is not None:
                for r in range(b):
                    if active[r] and r not in forced:
                        nodes = [tree.index_of(r, n) for n in range(len(drafts[r][0]))]
                        row_tops = [(tops[0][r][i], tops[1][r][i]) for i in nodes]
                        drafter.observe(r, contexts[r], drafts[r], row_tops, emitted[r])
            stats.verify_steps += 1
            stats.tree_nodes_per_step.append(max(len(d[0]) for d in drafts))
            all_accepted = True
            if adaptive:
                for r in range(b):
                    if done[r] or r in forced:
                        continue
                    if depth > 0:
                        acceptance.update(r, _depth_of(drafts[r]), len(emitted[r]) - 1)
                    elif shadow is not None and len(shadow[r][0]) > 1:
                        acceptance.update(r, 1, int(emitted[r][0] in shadow[r][0][1:]))
                    else:
                        acceptance.elapse(r)
            for r in range(b):
                if r in forced:
                    n = forced[r] + 1
                    pads[r] += n
                elif active[r]:
                    stats.row_steps += 1
                    stats.accepted_tokens += len(emitted[r]) - 1
                    all_accepted &= len(emitted[r]) == len(drafts[r][0])
                    n = emit(r, emitted[r])
                    if ties is not None:
                        stats.near_ties += sum(ties[r][:n])
                    cut[r] = path_list[r][n - 1]  # a row that stopped inside the block commits only what it emitted
                else:
                    continue
                if keep:
                    kept[r].extend((scores[r, node].clone(), raw[r, node].clone()) for node in path_list[r][:n])
            if wants_features:  # handed to the drafter when it next drafts (plain steps in a row need only the last)
                pending = (runner.features, list(cut), [r for r in range(b) if active[r] and r not in forced])
            runner.commit(torch.tensor(cut, dtype=torch.long))  # on the host: the commit uploads what it needs
            stream.release(generated, done)
            if goodput is not None:  # judged by how much nearer its end the step brought the batch
                # (tensor parallelism: the slowest process's times, so every process takes the same decisions)
                elapsed, shadow_seconds = runner.agreement.seconds([time.perf_counter() - started, shadow_seconds])
                seconds = elapsed - shadow_seconds
                if shadow is not None:
                    shadow_cost = shadow_seconds
                    shadow_budget -= shadow_seconds
                goodput.record(tree.num_nodes, seconds, batch_progress(remaining, done_before, generated, done,
                                                                       max_new_tokens, emitted))  # fmt: skip
                if tree.num_nodes <= 1:  # a shadow waits until the plain steps since the last one paid for it
                    shadow_budget = min(shadow_budget + SHADOW_SHARE * seconds, 2 * shadow_cost)
            if schedule != "constant":
                depth_limit = depth_limit + 2 if all_accepted else max(1, depth_limit - 1)
                if static_shapes:
                    depth_limit = min(depth_limit, num_draft_tokens)
    finally:  # the drafter's thread and counters, also when a step fails
        drafter.finish(stats)
    if goodput is not None:
        profiles[profile_key] = acceptance.profile()
    width = max(len(g) for g in generated)
    if keep:
        _catch_up_scores(runner, dec, kept, ids, pads, width, pad_token_id, device)
        dec.scores = tuple(torch.stack([kept[r][k][0] for r in range(b)]) for k in range(width))
        dec.logits = tuple(torch.stack([kept[r][k][1] for r in range(b)]) for k in range(width))
    stream.end()
    out = torch.full((b, width), pad_token_id, dtype=input_ids.dtype, device=device)
    for r, g in enumerate(generated):
        out[r, : len(g)] = torch.tensor(g, dtype=input_ids.dtype)
    return torch.cat([input_ids, out], dim=1), stats, runner


def _catch_up_scores(runner, dec, kept, ids, pads, width, pad_token_id, device) -> None:
    """Rows that finished before the last one still owe HF's scores up to `width`: decode pads for them (as
    HF's loop does for finished rows) until every row has one score per generated column."""
    b = len(kept)
    while any(len(k) < width for k in kept):
        need = [width - len(k) for k in kept]
        longest = runner.max_depth if runner.static_shapes else 15
        chains = [min(n - 1, longest) if n > 0 else -1 for n in need]
        drafts = [[ids(r)[-1]] + [pad_token_id] * max(k, 0) for r, k in enumerate(chains)]
        chain_parents = [list(range(-1, len(d) - 1)) for d in drafts]
        tree = runner.prepare(TokenTree.from_lists(drafts, chain_parents, device=device))
        raw = runner.verify(tree).float()
        scores = dec.score_tree(tree, raw, [ids(r) if chains[r] >= 0 else None for r in range(b)])
        last = torch.tensor([tree.index_of(r, max(k, 0)) for r, k in enumerate(chains)], device=device)
        path = tree.paths(last)[0].tolist()
        for r, k in enumerate(chains):
            if k >= 0:
                kept[r].extend((scores[r, node].clone(), raw[r, node].clone()) for node in path[r][: k + 1])
                pads[r] += k + 1
        runner.commit(last)


# a plain step chosen for low acceptance drafts one token in the shadow every this many steps, to follow the rates
SHADOW_EVERY = 4
SHADOW_MAX = 32
# ... and spends at most this share of the plain steps' time on them (at batch 32 on the embedded target a shadow
# draft cost about 5 ms against a 10-13 ms plain step: every 4 steps, about 10% of the time)
SHADOW_SHARE = 0.01
# where the acceptance model prices every depth below this fraction of plain decoding's rate (and nothing measured
# says otherwise), the next REPRICE_EVERY steps decode plainly without pricing: at batch 8-32, where speculation does
# not pay on the embedded target, pricing every step cost about 1% of a call (8 ms of 640 at batch 8)
FAR_FROM_PAYING = 0.85
REPRICE_EVERY = 4


def _observe_features(drafter: Drafter, pending: tuple | None) -> None:
    """Hand the drafter the target's features at each row's last committed position, from the step that committed
    last (`pending`: its features [B, N, H], the committed node per row, the rows to tell; after the prefill, its
    features and the last position): one gather, a view per row. Deferred to the next drafting call: a run of plain
    steps (a batch where speculation does not pay) pays for none of it. Returns None (nothing pending)."""
    if pending is not None:
        feats, cut, rows = pending
        at = feats[torch.arange(len(cut), device=feats.device), torch.tensor(cut, device=feats.device)].unbind(0)
        for r in rows:
            drafter.observe_features(r, at[r])
    return None


def _drafter_kind(drafter: Drafter) -> str:
    """What an acceptance profile is kept under: the drafter's class and those of the drafters it wraps."""
    inner = [getattr(drafter, name, None) for name in ("draft", "retrieval", "base")]
    return "/".join([type(drafter).__name__] + [_drafter_kind(d) for d in inner if isinstance(d, Drafter)])


def batch_progress(
    remaining: list[int],
    done_before: list[bool],
    generated: list[list[int]],
    done: list[bool],
    max_new_tokens: int,
    emitted: list[list[int]],
) -> int:
    """How much nearer its end a step brought the batch: how far the most tokens any unfinished row has left to
    generate fell (`remaining` and `done_before`: before the step), at most the most tokens a row emitted (a row
    that stops at EOS ends no sooner for the others). A batch ends with its last row, so the rows that gained more
    than the slowest did not shorten it: at batch 4 the tokens per row of the rows the batch waits for measured
    speculation winning by 10% where it was 0.93x plain decoding."""
    before = [n for n, d in zip(remaining, done_before) if not d]
    if not before:
        return 0
    after = [max_new_tokens - len(g) for g, d in zip(generated, done) if not d]
    most = max((len(e) for e, d in zip(emitted, done_before) if not d), default=0)
    return max(0, min(max(before) - max(after, default=0), most))


# prompt positions (the last ones) whose top-k a recycling drafter is told after the prefill
PROMPT_TOPK_POSITIONS = 2048


def _top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely next tokens per position and their probabilities (softmax of the raw logits)."""
    logits = logits.float()
    values, ids = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return ids, (values - logits.logsumexp(-1, keepdim=True)).exp()


def near_tie_tolerance(dtype: torch.dtype) -> float:
    """Relative top-2 gap below which a greedy token could flip under other rounding: 8 ulps of the dtype."""
    return 8 * torch.finfo(dtype).eps


def _near_ties(logits: torch.Tensor, tolerance: float) -> torch.Tensor:
    """Per position, whether the top-2 logit gap is below tolerance * max(1, |top logit|)."""
    top = logits.float().topk(2, dim=-1).values
    return (top[..., 0] - top[..., 1]) < tolerance * top[..., 0].abs().clamp(min=1.0)


def _depth_of(draft: tuple[list[int], list[int]]) -> int:
    """How deep a drafted tree goes."""
    depth = [0] * len(draft[1])
    for t in range(1, len(depth)):
        depth[t] = depth[draft[1][t]] + 1
    return max(depth)


def cost_curve(model: nn.Module, runner: ModelRunner | GenericRunner) -> dict[int, float]:
    """The model's verify-cost curve (relative to a decode step) for this batch size, measured once per model up
    to the largest tree the call verifies (extended when a later call verifies larger ones) and kept on the
    model (so each model has its own; nothing process-wide)."""
    curves = model.__dict__.setdefault("_ssmspec_cost_curves", {})
    seconds = model.__dict__.setdefault("_ssmspec_decode_seconds", {})
    packing = model.__dict__.setdefault("_ssmspec_packing", {})  # per curve: packed linears or F.linear per size
    key = _curve_key(runner)
    if chooses_packing(runner):
        runner.packed_sizes = dict(packing.get(key, {})) or None
    # the sizes this call can verify (powers of two up to its largest padded tree): a compiled model compiles a
    # graph per size measured, so sizes no tree of this call reaches are left to a call that needs them
    largest = runner.padded_size(runner.max_nodes) if runner.max_nodes else COST_SIZES[-1]
    sizes = [n for n in COST_SIZES if n < largest] + [largest]
    curve = curves.get(key, {})
    missing = [n for n in sizes if n > max(curve, default=0)]  # sizes within the curve are interpolated
    if missing:
        curves[key] = curve = merge_curves(curve, measure_cost(runner, sorted({1, *missing})))
        seconds[key] = runner.decode_seconds
        if runner.__dict__.get("packed_sizes"):
            packing[key] = dict(runner.packed_sizes)
    return curve


def _cap(drafts, qs, forced, cap: int):
    """Every row's draft cut to its first `cap` nodes (root included; parents precede children, so a prefix is a
    tree), its proposal distributions to the nodes kept; a finished row's pad chain shortened in `forced`."""
    out, kept_qs = [], []
    for r, ((tokens, parents), q) in enumerate(zip(drafts, qs)):
        out.append((tokens[:cap], parents[:cap]))
        kept_qs.append({n: v for n, v in q.items() if n < cap} if q else q)
        if r in forced:
            forced[r] = min(forced[r], cap - 1)
    return out, kept_qs


def _curve_key(runner: ModelRunner | GenericRunner) -> tuple:
    """What a cost curve (and its timing) is kept under on the model: batch size and device; HF's forward on the
    generic path has curves of its own."""
    key = (runner.cache.n_real.shape[0], runner.cache.n_real.device.type)
    return (*key, runner.path) if isinstance(runner, GenericRunner) else key


def cost_seconds(model: nn.Module, runner: ModelRunner | GenericRunner) -> float | None:
    """A decode step's forward in seconds, as measured with the model's cost curve for this runner's batch (the
    curve's base, `cost_curve`)."""
    key = _curve_key(runner)
    return model.__dict__.get("_ssmspec_decode_seconds", {}).get(key)  # None: a curve set without its timing


def _trim(tokens: list[int], parents: list[int], max_depth: int) -> tuple[list[int], list[int], dict[int, int]]:
    """Drop drafted nodes deeper than max_depth (no use drafting past max_new_tokens); returns the kept
    tokens, their parents and where each kept node went."""
    if len(tokens) == 1:  # a root alone (a plain decoding step, most steps at large batches): nothing to trim
        return [tokens[0]], [-1], {0: 0}
    depth = [0] * len(tokens)
    keep = [0]
    new_index = {0: 0}
    for t in range(1, len(tokens)):
        depth[t] = depth[parents[t]] + 1
        if depth[t] <= max_depth and parents[t] in new_index:
            new_index[t] = len(keep)
            keep.append(t)
    return [tokens[t] for t in keep], [-1] + [new_index[parents[t]] for t in keep[1:]], new_index
