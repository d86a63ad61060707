"""What the scheduler's policy promises, beyond the answers: the order in which requests are admitted,
run and preempted. A scheduler that breaks it gives every request the answer it would get alone (in
invariant mode, bit for bit), so no answer property can see it; it shows as a request that waits behind
later arrivals, or never runs, under load.

The promise (engine/scheduler.py; vLLM's FCFS with preemption by recompute), read from the run itself:
the schedule's arrivals and aborts, the trace's scheduled chunks and preemptions, the outputs' finish
steps. A model of the two queues is replayed step by step, never the engine's own:
- a request joins the back of the waiting queue when it arrives (an n > 1 request's children in order);
  an abort removes it from either queue;
- a preemption takes the most recently admitted running request and puts it at the front of the
  waiting queue;
- the running requests that get tokens in a step are the oldest ones, in admission order (a run of
  them from the first: nobody older is skipped, so the oldest always progresses and nothing starves);
- the requests admitted in a step are the front of the waiting queue, and only in a step where every
  running request got tokens and none was preempted;
- a request leaves the running ones in the step it finishes.
Under fcfs a step's chunks come in that order (the running ones, then the admitted ones in queue order);
the other scheduling policies only reorder a step's chunks, so for them the promise is on sets.
Guarded by tests/test_policy.py.
"""
from __future__ import annotations

from collections import defaultdict

from ..engine import RequestOutput
from .schedule import Schedule, children


def policy_problems(schedule: Schedule, outputs: dict[str, RequestOutput], trace: list[dict]) -> list[str]:
    """One line per step that broke the promise (see module); empty when the run kept it."""
    arrivals = defaultdict(list)
    for request in sorted(schedule.requests, key=lambda r: r.arrival_step):  # the driver's order
        arrivals[request.arrival_step] += [child.id for child in children(request)]
    finished = defaultdict(set)
    for rid, out in outputs.items():
        if out.finish_step is not None:
            finished[out.finish_step].add(rid)
    in_order = schedule.engine.scheduling_policy == "fcfs"  # the others reorder a step's chunks
    waiting: list[str] = []
    running: list[str] = []
    problems = []
    for entry in trace:
        step = entry["step"]
        waiting += arrivals.get(step, [])
        gone = set(entry["aborted"])
        waiting = [r for r in waiting if r not in gone]
        running = [r for r in running if r not in gone]
        for rid in entry["preempted"]:
            if not running or running[-1] != rid:
                problems.append(f"step {step}: preempted {rid}, not the most recently admitted running request "
                                f"({running[-1] if running else 'none runs'})")
                return problems  # the model no longer knows the queues
            waiting.insert(0, running.pop())
        scheduled = {chunk["id"] for chunk in entry["scheduled"]}
        ran = [r for r in running if r in scheduled]
        if ran != running[:len(ran)]:
            skipped = next(r for r, got in zip(running, ran + [None]) if r != got)
            problems.append(f"step {step}: ran {ran} of the running {running}, skipping the older {skipped}")
        admitted = [chunk["id"] for chunk in entry["scheduled"] if chunk["id"] not in running]
        head = waiting[:len(admitted)]
        if (admitted if in_order else sorted(admitted)) != (head if in_order else sorted(head)):
            problems.append(f"step {step}: admitted {admitted} while the front of the waiting queue was {head}")
            return problems
        if admitted and (entry["preempted"] or len(ran) < len(running)):
            problems.append(f"step {step}: admitted {sorted(admitted)} in a step where a running request "
                            f"{'was preempted' if entry['preempted'] else 'got no tokens'}")
        running += head
        waiting = waiting[len(head):]
        running = [r for r in running if r not in finished[step]]
    return problems
