"""``forge-pool-export``: the data pool's episodes as JSON lines, for looking at what the agents did and were scored.

The pool keeps every episode it was sent in its SQLite database (tokens, loss mask, the engine's logprobs, policy
versions, images) and, once a group finishes, its scores (composite rewards, segment advantages). This reads that
database (read-only; a pool serving it meanwhile is not disturbed: SQLite's WAL mode lets readers in) and writes one
JSON object per episode, oldest group first::

    forge-pool-export --db runs/slurm-123/pool.sqlite --out episodes.jsonl --tokenizer /models/Qwen3-8B

Each line: ``episode_id``, ``group`` (the pool's group index, in submission order) and ``group_id``, ``task_id``,
``domain``, ``group_state`` (running, finished, filtered, failed, delivered, committed, ...), ``batch_id`` and
``staleness`` once delivered, ``status`` (finished, failed, timed_out), the agent's or verifier's outcome ``reward``
and ``reward_terms``, the composite ``score`` and per-segment ``advantages`` and ``success`` once the group is
scored, times and tool-call counts, the task ``metadata``, and per segment its ``tokens`` and ``sampled_tokens``
counts, the range of ``policy_versions`` that sampled it, the ``mean_logprob`` of its sampled tokens and its number
of ``images``; with ``--tokenizer`` the segment's ``text`` and the ``sampled_text`` (the model's own tokens), with
``--token-ids`` the per-token arrays, with ``--images-dir DIR`` the images written there as PNG files (their paths
in ``image_files``).

``--sft`` writes token samples instead, one ``{"input_ids", "loss_mask", "episode_id", "segment"}`` per segment (the
model's sampled tokens trained), for ``forge-sft --data``: rejection-sampling fine-tuning on the run's own tokens,
exactly as they were sampled (no chat template, no re-tokenisation); ``--successful`` keeps the episodes their group
scored successful, ``--min-score S`` those whose composite score is at least S (both need scored groups); segments
with images are left out (counted on stderr).

``--pairs`` writes preference pairs of token samples instead, for ``forge-rm`` / ``forge-dpo --data``: within each
scored group the best-scored episode against the worst, the next best against the next worst, and so on while the
chosen one's composite score exceeds the rejected one's by more than ``--min-gap`` (default 0: any difference;
``--every-pair``: every two episodes so far apart, which the prefix tree still trains as one forest per group);
each side is the episode's last segment (its final context and answer), the sampled tokens as its loss mask. One
``{"chosen": {"input_ids", "loss_mask"}, "rejected": {...}, "group", "task_id", "chosen_score", "rejected_score",
"chosen_episode", "rejected_episode"}`` per line; episodes whose last segment has images are left out (counted).

``--kto`` writes KTO examples of token samples instead, for ``forge-kto --data`` / the trainer's ``--kto-data``: each
scored episode's last segment labelled desirable when its composite score is above its group's mean by more than
``--min-gap`` and undesirable when below it by as much (the rest, and groups whose episodes all scored alike, left
out): ``{"input_ids", "loss_mask", "label", "group", "task_id", "score", "group_mean", "episode_id", "segment"}`` per
line. Unlike pairs, every scored episode can teach, and groups of any size give as many examples as they have
episodes; ``--every-segment`` makes each segment of an episode an example with its label (an agent that rewrote its
context acted in every segment), the group's mean still taken over episodes.

Trajectories a pool did not keep (committed, filtered or failed groups without ``--keep-trajectories``) have no
tokens left: such episodes are counted on stderr, not written. ``--state``, ``--task-id``, ``--from-group`` and
``--limit`` select episodes. Exit status 2 with a message for a missing or foreign database.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sqlite3
import sys

import msgpack

from forge_megatron.middleware.pool import group_id_of
from forge_megatron.middleware.wire import episode_from_blob


def open_readonly(path: str) -> sqlite3.Connection:
    """A read-only connection to a pool database; ValueError when it is not one."""
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} does not exist (the pool's --db / --pool-db file)")
    db = sqlite3.connect(f"file:{os.path.abspath(path)}?mode=ro", uri=True, timeout=30.0)
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not {"groups", "episodes"} <= tables:
        db.close()
        raise ValueError(f"{path!r} is not a data pool database (tables {sorted(tables)})")
    return db


def episode_records(db: sqlite3.Connection, states: set[str] | None = None, task_id: str | None = None,
                    from_group: int = 0):
    """(group row, Episode | None) in group order, then submission order; None where the pool deleted the
    trajectory."""
    query = ("SELECT g.idx, g.task_id, g.domain, g.state, g.scores, g.batch_id, g.staleness, g.metadata, "
             "e.blob FROM groups g JOIN episodes e ON e.group_idx = g.idx WHERE g.idx >= ?")
    args: list = [from_group]
    if task_id is not None:
        query += " AND g.task_id = ?"
        args.append(task_id)
    query += " ORDER BY g.idx, e.submitted_seq IS NULL, e.submitted_seq, e.episode_id"
    for row in db.execute(query, args):
        group = dict(zip(("idx", "task_id", "domain", "state", "scores", "batch_id", "staleness", "metadata"), row[:8]))
        if states and group["state"] not in states:
            continue
        yield group, (episode_from_blob(row[8]) if row[8] is not None else None)


def episode_json(group: dict, episode, tokenizer=None, token_ids: bool = False, images_dir: str | None = None) -> dict:
    """The JSON object of one episode (see the module docstring)."""
    scores = msgpack.unpackb(group["scores"]) if group["scores"] else None
    out = {"episode_id": episode.episode_id, "group": group["idx"], "group_id": group_id_of(group["idx"]),
           "task_id": group["task_id"],
           "domain": group["domain"], "group_state": group["state"], "batch_id": group["batch_id"],
           "staleness": group["staleness"], "status": episode.status, "reward": episode.reward,
           "reward_terms": dict(episode.reward_terms)}
    if scores and episode.episode_id in scores.get("episode_ids", ()):
        k = scores["episode_ids"].index(episode.episode_id)
        out.update(score=scores["rewards"][k], advantages=scores["segment_advantages"][k],
                   success=scores["successes"][k])
    out.update(started_at=episode.started_at, ended_at=episode.ended_at,
               duration_s=max(0.0, episode.ended_at - episode.started_at), num_tool_calls=episode.num_tool_calls,
               num_malformed_tool_calls=episode.num_malformed_tool_calls,
               num_truncated_calls=episode.num_truncated_calls,
               metadata={**msgpack.unpackb(group["metadata"]), **episode.metadata}, segments=[])
    for s, seg in enumerate(episode.segments):
        sampled = [i for i, m in enumerate(seg.loss_mask) if m]
        versions = [seg.policy_versions[i] for i in sampled]
        record = {"tokens": len(seg.tokens), "sampled_tokens": len(sampled),
                  "policy_versions": [min(versions), max(versions)] if versions else None,
                  "mean_logprob": (sum(seg.rollout_logprobs[i] for i in sampled) / len(sampled)) if sampled else None,
                  "images": len(seg.images or ())}
        if tokenizer is not None:
            record["text"] = tokenizer.decode(seg.tokens)
            record["sampled_text"] = tokenizer.decode([seg.tokens[i] for i in sampled])
        if token_ids:
            record.update(token_ids=list(seg.tokens), loss_mask=list(seg.loss_mask),
                          rollout_logprobs=list(seg.rollout_logprobs),
                          policy_version_per_token=list(seg.policy_versions))
        if images_dir is not None and seg.images:
            os.makedirs(images_dir, exist_ok=True)
            record["image_files"] = []
            for i, data in enumerate(seg.images):
                digest = hashlib.sha1(data).hexdigest()[:8]
                path = os.path.join(images_dir, f"{episode.episode_id}-s{s}-{i}-{digest}.png")
                with open(path, "wb") as f:
                    f.write(data)
                record["image_files"].append(path)
        out["segments"].append(record)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="forge-pool-export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db", required=True, help="the pool's SQLite file (forge-pool --db, forge-node --pool-db)")
    p.add_argument("--out", default="-", help="JSON lines file (default: standard output)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the served model's tokenizer (a local directory): adds each segment's text")
    p.add_argument("--token-ids", action="store_true", help="add the per-token arrays of each segment")
    p.add_argument("--images-dir", default=None, metavar="DIR", help="write the episodes' images there as PNG files")
    p.add_argument("--state", action="append", default=None, metavar="STATE",
                   help="only groups in this state (repeatable): running, finished, filtered, failed, delivered, "
                        "committed")
    p.add_argument("--task-id", default=None, help="only this task's groups")
    p.add_argument("--from-group", type=int, default=0, help="only groups with this index or later")
    p.add_argument("--limit", type=int, default=None, help="stop after this many episodes")
    p.add_argument("--sft", action="store_true",
                   help="write token samples {input_ids, loss_mask} per segment for forge-sft --data instead")
    p.add_argument("--successful", action="store_true", help="only episodes their scored group counts successful")
    p.add_argument("--min-score", type=float, default=None, help="only episodes whose composite score is at least this")
    p.add_argument("--pairs", action="store_true",
                   help="write preference pairs of each scored group's episodes for forge-rm / forge-dpo --data")
    p.add_argument("--kto", action="store_true",
                   help="write KTO examples (each scored episode desirable or not against its group's mean) for "
                        "forge-kto --data / the trainer's --kto-data")
    p.add_argument("--min-gap", type=float, default=0.0,
                   help="--pairs: the chosen episode's score must exceed the rejected one's by more than this; "
                        "--kto: an episode's score must differ from its group's mean by more than this")
    p.add_argument("--every-segment", action="store_true",
                   help="--kto: every segment of an episode an example with the episode's label (an agent that "
                        "rewrote its context acted in each), not only its last")
    p.add_argument("--every-pair", action="store_true",
                   help="--pairs: every two episodes of a group whose scores differ by more than --min-gap (K(K-1)/2 "
                        "at most; a reward model learns more from them), not only best against worst")
    return p


def selected(record: dict, successful: bool, min_score: float | None) -> bool:
    """Whether an episode's JSON object passes ``--successful`` / ``--min-score`` (unscored episodes never do)."""
    if successful and record.get("success") is not True:
        return False
    return min_score is None or (record.get("score") is not None and record["score"] >= min_score)


def sft_samples(episode) -> tuple[list[dict], int]:
    """(token samples of the episode's segments, how many segments with images were left out)."""
    out, skipped = [], 0
    for k, seg in enumerate(episode.segments):
        if seg.images:
            skipped += 1
        elif any(seg.loss_mask[1:]):
            out.append({"input_ids": list(seg.tokens), "loss_mask": list(seg.loss_mask),
                        "episode_id": episode.episode_id, "segment": k})
    return out, skipped


def _scored_last_segments(group: dict, episodes: list, every_segment: bool = False) -> tuple[list[tuple], int]:
    """([(score, episode id, segment index, segment)] of a group's scored episodes that train a token, in submission
    order: each episode's last segment (``every_segment``: each of its segments); how many were left out for
    images)."""
    scores = msgpack.unpackb(group["scores"]) if group["scores"] else None
    if not scores:
        return [], 0
    score_of = dict(zip(scores["episode_ids"], scores["rewards"]))
    scored, with_images = [], 0
    for episode in episodes:
        if episode.episode_id not in score_of or not episode.segments:
            continue
        first = 0 if every_segment else len(episode.segments) - 1
        for k in range(first, len(episode.segments)):
            seg = episode.segments[k]
            if not any(seg.loss_mask[1:]):
                continue
            if seg.images:
                with_images += 1
                continue
            scored.append((score_of[episode.episode_id], episode.episode_id, k, seg))
    return scored, with_images


def group_kto_examples(group: dict, episodes: list, min_gap: float,
                       every_segment: bool = False) -> tuple[list[dict], int]:
    """(KTO examples of one group's scored episodes, how many segments were left out for images) (module docstring);
    ``every_segment``: each segment of an episode an example with the episode's label, not only its last."""
    scored, with_images = _scored_last_segments(group, episodes, every_segment)
    scores = {episode_id: score for score, episode_id, _, _ in scored}  # (the mean over episodes, not segments)
    if not scores:
        return [], with_images
    mean = sum(scores.values()) / len(scores)
    out = []
    for score, episode_id, k, seg in scored:
        if abs(score - mean) <= min_gap:
            continue
        out.append({"input_ids": list(seg.tokens), "loss_mask": list(seg.loss_mask), "label": score > mean,
                    "group": group["idx"], "task_id": group["task_id"], "score": score, "group_mean": mean,
                    "episode_id": episode_id, "segment": k})
    return out, with_images


def group_pairs(group: dict, episodes: list, min_gap: float, every_pair: bool = False) -> tuple[list[dict], int]:
    """(preference pairs of one group's scored episodes, how many were left out for images) (module docstring);
    ``every_pair``: every two episodes whose scores differ by more than ``min_gap``, not only best against worst."""
    ranked, with_images = _scored_last_segments(group, episodes)
    ranked = [(score, episode_id, seg) for score, episode_id, _, seg in ranked]
    ranked.sort(key=lambda x: -x[0])  # (stable: ties keep submission order)
    if every_pair:
        matches = [(i, j) for i in range(len(ranked)) for j in range(i + 1, len(ranked))
                   if ranked[i][0] - ranked[j][0] > min_gap]
    else:  # best against worst, next best against next worst, ... while the gap holds
        matches = []
        for i in range(len(ranked) // 2):
            if ranked[i][0] - ranked[-1 - i][0] <= min_gap:
                break
            matches.append((i, len(ranked) - 1 - i))
    pairs = []
    for i, j in matches:
        (best, best_id, chosen), (worst, worst_id, rejected) = ranked[i], ranked[j]
        if list(chosen.tokens) == list(rejected.tokens):
            continue
        pairs.append({"chosen": {"input_ids": list(chosen.tokens), "loss_mask": list(chosen.loss_mask)},
                      "rejected": {"input_ids": list(rejected.tokens), "loss_mask": list(rejected.loss_mask)},
                      "group": group["idx"], "task_id": group["task_id"], "chosen_score": best,
                      "rejected_score": worst, "chosen_episode": best_id, "rejected_episode": worst_id})
    return pairs, with_images


def _export_groups(db, args, out) -> str:
    """Write ``--pairs`` or ``--kto`` (lines made per scored group); the summary line."""
    written, missing, with_images, groups, desirable = 0, 0, 0, set(), [0]

    def flush(group, episodes):
        nonlocal written, with_images
        pairs, skipped = group_kto_examples(group, episodes, args.min_gap, args.every_segment) if args.kto else \
            group_pairs(group, episodes, args.min_gap, args.every_pair)
        with_images += skipped
        if args.limit is not None:
            pairs = pairs[:max(0, args.limit - written)]
        out.writelines(json.dumps(x) + "\n" for x in pairs)
        written += len(pairs)
        desirable[0] += sum(bool(x.get("label")) for x in pairs)
        if pairs:
            groups.add(group["idx"])

    current, episodes = None, []
    for group, episode in episode_records(db, set(args.state or ()), args.task_id, args.from_group):
        if current is not None and group["idx"] != current["idx"]:
            flush(current, episodes)
            episodes = []
        current = group
        if episode is None:
            missing += 1
        else:
            episodes.append(episode)
        if args.limit is not None and written >= args.limit:
            break
    if current is not None and (args.limit is None or written < args.limit):
        flush(current, episodes)
    kind = "segment(s)" if getattr(args, "every_segment", False) else "episode(s)"
    note = f", {with_images} {kind} with images left out" if with_images else ""
    note += f"; {missing} episode(s) without a trajectory (not kept: --keep-trajectories)" if missing else ""
    if args.kto:
        return f"{written} KTO example(s) ({desirable[0]} desirable) of {len(groups)} group(s) written{note}"
    return f"{written} pair(s) of {len(groups)} group(s) written{note}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.pairs and args.kto:
        parser.error("--pairs or --kto: one form per export")
    for flag, on in (("--pairs", args.pairs), ("--kto", args.kto)):
        if on and (args.sft or args.successful or args.min_score is not None):
            parser.error(f"{flag} labels every scored group's episodes by score: it takes no --sft, --successful or "
                         "--min-score")
    if args.min_gap < 0:
        parser.error("--min-gap must be at least 0")
    if args.every_pair and not args.pairs:
        parser.error("--every-pair is for --pairs")
    if args.every_segment and not args.kto:
        parser.error("--every-segment is for --kto")
    try:
        db = open_readonly(args.db)
    except (ValueError, sqlite3.Error) as exc:
        print(f"forge-pool-export: {exc}", file=sys.stderr)
        return 2
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
        except (OSError, ValueError) as exc:
            print(f"forge-pool-export: --tokenizer {args.tokenizer!r}: {exc}", file=sys.stderr)
            return 2
    out = sys.stdout if args.out == "-" else open(args.out, "w")
    written, missing, samples, with_images, groups = 0, 0, 0, 0, set()
    if args.pairs or args.kto:
        try:
            print(f"forge-pool-export: {_export_groups(db, args, out)}", file=sys.stderr)
        finally:
            if out is not sys.stdout:
                out.close()
            db.close()
        return 0
    try:
        for group, episode in episode_records(db, set(args.state or ()), args.task_id, args.from_group):
            if args.limit is not None and written >= args.limit:
                break
            if episode is None:
                missing += 1
                continue
            record = episode_json(group, episode, tokenizer, args.token_ids, None if args.sft else args.images_dir)
            if not selected(record, args.successful, args.min_score):
                continue
            if args.sft:
                lines, skipped = sft_samples(episode)
                with_images += skipped
                samples += len(lines)
                out.writelines(json.dumps(x) + "\n" for x in lines)
            else:
                out.write(json.dumps(record, default=str) + "\n")  # (metadata a task gave as bytes: as text)
            written += 1
            groups.add(group["idx"])
    finally:
        if out is not sys.stdout:
            out.close()
        db.close()
    note = f"; {missing} episode(s) without a trajectory (not kept: --keep-trajectories)" if missing else ""
    if args.sft:
        note = f" as {samples} token sample(s)" + (f", {with_images} segment(s) with images left out"
                                                  if with_images else "") + note
    print(f"forge-pool-export: {written} episode(s) of {len(groups)} group(s) written{note}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
