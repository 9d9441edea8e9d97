"""Hardware exploration speed: the 4-parameter frontier of examples/explore_h100.yaml.

    python benchmarks/explore_speed.py [SPEC.yaml]

Llama-3 70B on 1,024 GPUs of a DGX-H100-like cluster; dense compute, HBM bandwidth, NVLink and
NIC bandwidth vary. Prints the wall time, the number of hardware candidates and the frontier.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from stage_cosim.search.explore import explore
from stage_cosim.search.explore_spec import load_spec


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "examples" / "explore_h100.yaml"
    spec = load_spec(path)
    t = time.perf_counter()
    doc = explore(spec)
    dt = time.perf_counter() - t
    b = doc["baseline"]
    print(f"{path.name}: {len(spec.variables)} variables, {doc['candidates_evaluated']} hardware candidates, "
          f"{len(doc['frontier'])} frontier points in {dt:.1f} s")
    p = b["best"]["point"]
    layout = " ".join(f"{k}={v}" for k, v in sorted(p.items()))
    proof = ("its proven optimum" if b["proven_optimal"] else
             f"not proven optimal, {b['unexplored']:,} feasible configurations not simulated")
    print(f"baseline ${b['cost_per_gpu']:,.0f}/GPU: {b['step_time_s']:.3f} s/step ({layout}; {proof})")
    for c in doc["frontier"]:
        values = ", ".join(f"{k.split('.')[-1]}={v:.0f}" for k, v in c["values"].items())
        print(f"  ${c['cost_per_gpu']:>9,.0f}  {c['step_time_s']:.3f} s  {values}")
    print("sensitivity (elasticity of step time):",
          ", ".join(f"{d['variable']} {d['elasticity']:+.3f}" for d in doc["sensitivity"] if d["elasticity"] is not None))


if __name__ == "__main__":
    main()
