"""Runs the barrier model of fp8_skip_barriers.py (the fp8 Gluon forward with
`Fp8ForwardConfig.skip_empty_halves`): random tile sequences for the control without the
skip, the skip as committed and three mutants of it (the first must stay clean, being
harmless; the other two must fail), then every NI x ring depth x pattern.

    python3 benchmarks/experiments/fp8_skip_barriers_campaign.py 4000

An experiment, not kept (docs/fp8.md, "What would close it", item 5).
"""

import sys

from fp8_skip_barriers import campaign, run


def main() -> None:
    runs = int(sys.argv[1])
    for label, skip, mutant, n in [
            ("control: no skip", False, None, runs),
            ("skip (as committed)", True, None, runs),
            ("mutant: skip releases without waiting ready", True, "no_ready_wait", runs),
            ("mutant: no x_ready wait", True, "no_x_wait", runs // 5),
            ("mutant: last block takes 0 stages", True, "short_last", runs // 5)]:
        for seed0 in (1, 2):
            tally, examples = campaign(n // 2, skip, mutant, seed0=seed0)
            print(label, seed0, tally, {k: (v[0], v[1], v[2][:8], str(v[3])[:160])
                                        for k, v in examples.items()}, flush=True)
    patterns = [[True] * 4, [False] * 4, [True, False] * 3, [False, True] * 3,
                [False, False, True], [True, True, False, False, True]]
    bad = total = 0
    for NI in (1, 2, 3, 20):
        for stages in range(3, 8):
            for pattern in patterns:
                for skip in (False, True):
                    for s in range(20):
                        result, info = run(NI, stages, pattern, skip, seed=1000 * s + stages)
                        total += 1
                        if result != "ok":
                            bad += 1
                            print("FAIL", NI, stages, pattern, skip, result, info)
    print("targeted", total, "runs,", bad, "failures")


if __name__ == "__main__":
    main()
