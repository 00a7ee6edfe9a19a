"""An independent simulator, written only from the memory model in ../shared/benchmarks/README.md.

It works on the plain JSON document (no project types) so that it checks the project's simulator
and exporter rather than sharing their code.
"""


def replay(doc: dict) -> tuple[int, float]:
    """Return (peak_bytes, total_cost) of a remat-schedule document; assert on any invalid op."""
    nodes = {nd["id"]: nd for nd in doc["graph"]["nodes"]}
    live = set()
    mem = doc["graph"]["fixed_bytes"]
    peak = mem
    cost = 0.0
    done = set()
    for kind, v in doc["ops"]:
        nd = nodes[v]
        if kind == "compute":
            assert all(i in live for i in nd["inputs"]), f"compute {v}: input missing"
            assert v not in live
            live.add(v)
            mem += nd["bytes"]
            peak = max(peak, mem)
            cost += nd["cost"]
            done.add(v)
        else:
            assert v in live, f"free {v}: not resident"
            live.remove(v)
            mem -= nd["bytes"]
    consumed = {i for nd in nodes.values() for i in nd["inputs"]}
    assert all(v in done for v in nodes if v not in consumed), "a sink was never computed"
    assert all(v in live for v, nd in nodes.items() if nd["retain"]), "a retained value was freed"
    return peak, cost
