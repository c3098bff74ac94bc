"""A model of the barrier protocol of _expert_forward_fp8_sm90_kernel (one program).

mbarriers with arrival counts, transaction bytes and phase parity (waits alias after two
phases, as try_wait.parity does); the weight loader (_w_loader), the x loader (_x_loader,
32 threads each arriving with cp.async.mbarrier.arrive.noinc), MMA warpgroups 0 and 1
(_mma_partition's compute path, and _skip_half for warpgroup 1 where its half is empty).
Async copies complete as separate random events.

Checks: deadlock; a TMA / cp.async writing a buffer a warpgroup still holds; a wait that
passes before its data landed (or on another fill's data); two warpgroups inside a turn;
the turn order (W0 b0, W1 b0, W0 b1, ...) and each warpgroup's stage order.
"""
from __future__ import annotations

import random
import sys


class Violation(Exception):
    pass


class MBar:
    def __init__(self, name, count):
        self.name, self.count, self.pending, self.tx, self.P = name, count, count, 0, 0

    def arrive(self, c=1):
        if c > self.pending:
            raise Violation(f"{self.name}: {c} arrivals with {self.pending} pending")
        self.pending -= c
        self._check()

    def expect(self, nbytes):  # mbarrier.arrive.expect_tx
        self.tx += nbytes
        self.arrive(1)

    def complete_tx(self, nbytes):
        self.tx -= nbytes
        self._check()

    def _check(self):
        if self.pending == 0 and self.tx == 0:
            self.P += 1
            self.pending = self.count

    def passes(self, parity):  # try_wait.parity
        return (self.P & 1) != parity


class World:
    def __init__(self, NI, NC, NSTAGE, tiles, mutation=None, w1_warps=1, rng=None):
        self.NI, self.NC, self.NSTAGE, self.tiles = NI, NC, NSTAGE, tiles
        self.mutation = mutation
        self.rng = rng
        self.ready = [MBar(f"ready{s}", 1) for s in range(NSTAGE)]
        self.empty = [MBar(f"empty{s}", 2) for s in range(NSTAGE)]
        self.x_ready = [MBar(f"x_ready{w}", 32) for w in range(2)]
        self.x_empty = [MBar(f"x_empty{w}", 1) for w in range(2)]
        self.turn = [MBar(f"turn{w}", 1) for w in range(2)]
        # slot -> [stage number in it, copies still in flight]
        self.slot = [[None, 0] for _ in range(NSTAGE)]
        self.xbuf = [[None, 0] for _ in range(2)]  # [tile, threads' copies in flight]
        self.holds = [set(), set()]  # stages each warpgroup reads
        self.xheld = [False, False]
        self.in_turn = None
        self.turn_log = []
        self.stage_log = [[], []]
        self.asyncs = []  # pending async completions: callables
        self.agents = {}
        self.w1_warps = w1_warps

    # --- the per-tile stage layout -------------------------------------------------
    def stages_per_tile(self):
        return self.NI * (self.NC + 1)

    # --- agents ----------------------------------------------------------------------
    def w_loader(self):
        n = 0
        for _t in self.tiles:
            for _j in range(self.NI):
                for c in range(self.NC + 1):  # NC gate|up stages, then the down stage
                    s = n % self.NSTAGE
                    yield ("wait", self.empty[s], ((n // self.NSTAGE) & 1) ^ 1)
                    copies = 4 if c == self.NC - 1 else 2 if c < self.NC else 1
                    self.ready[s].expect(copies)
                    for w in (0, 1):
                        for m in self.holds[w]:
                            if m % self.NSTAGE == s and m != n:
                                raise Violation(f"loader overwrites slot {s} (stage {n}) "
                                                f"while warpgroup {w} reads stage {m}")
                    if self.slot[s][1]:
                        raise Violation(f"slot {s} refilled with copies in flight")
                    self.slot[s] = [n, copies]

                    def done(s=s, n=n):
                        if self.slot[s][0] != n:
                            raise Violation("copy landed in a refilled slot")
                        self.slot[s][1] -= 1
                        self.ready[s].complete_tx(1)
                    for _ in range(copies):
                        self.asyncs.append(done)
                    n += 1
                    yield ("step",)

    def x_loader(self):
        for k, _t in enumerate(self.tiles):
            for w in (0, 1):
                yield ("wait", self.x_empty[w], (k & 1) ^ 1)
                if self.xheld[w]:
                    raise Violation(f"x loader writes half {w} (tile {k}) while it is held")
                if self.xbuf[w][1]:
                    raise Violation("x half rewritten with copies in flight")
                self.xbuf[w] = [k, 32]

                def done(w=w, k=k):
                    if self.xbuf[w][0] != k:
                        raise Violation("x copy landed in a refilled half")
                    self.xbuf[w][1] -= 1
                    self.x_ready[w].arrive(1)
                for _ in range(32):
                    self.asyncs.append(done)
                yield ("step",)

    # helpers of the MMA warpgroups (each a generator step list)
    def _wait_stage(self, W, n, lead=True):
        s = n % self.NSTAGE
        yield ("wait", self.ready[s], (n // self.NSTAGE) & 1)
        if self.slot[s][0] != n or self.slot[s][1]:
            raise Violation(f"warpgroup {W} passed ready for stage {n} but slot {s} holds "
                            f"stage {self.slot[s][0]} with {self.slot[s][1]} copies in flight")
        if lead:
            self.holds[W].add(n)
            self.stage_log[W].append(n)

    def _release(self, W, n):
        self.holds[W].discard(n)
        self.empty[n % self.NSTAGE].arrive(1)

    def _take_turn(self, W, blk, tile, b):
        yield ("wait", self.turn[W], (blk & 1) ^ (1 - W))
        if self.in_turn is not None:
            raise Violation(f"warpgroup {W} takes a turn inside warpgroup {self.in_turn}'s")
        self.in_turn = W
        self.turn_log.append((W, tile, b))

    def _pass_turn(self, W):
        self.in_turn = None
        self.turn[1 - W].arrive(1)

    def _wait_x(self, W, k):
        yield ("wait", self.x_ready[W], k & 1)
        if self.xbuf[W][0] != k or self.xbuf[W][1]:
            raise Violation(f"warpgroup {W} passed x_ready of tile {k} on "
                            f"{self.xbuf[W]}")
        self.xheld[W] = True

    def _give_x(self, W):
        self.xheld[W] = False
        self.x_empty[W].arrive(1)

    def mma(self, W, skip):
        NI, NC = self.NI, self.NC
        n = blk = 0
        for k, w1_empty in enumerate(self.tiles):
            if skip and W == 1 and w1_empty:
                yield from self.skip_half(W, k, n, blk)
                n += self.stages_per_tile()
                blk += NI + 1
                continue
            yield from self._wait_x(W, k)
            yield ("step",)  # quantize x
            yield from self._take_turn(W, blk, k, 0)
            yield from self._wait_stage(W, n)
            for c in range(1, NC):
                yield from self._wait_stage(W, n + c)
                yield ("step",)
                self._release(W, n + c - 1)
            held = n + NC - 1
            n += NC
            self._pass_turn(W)
            yield ("step",)
            self._give_x(W)
            yield ("step",)  # activation
            self._release(W, held)
            blk += 1
            for j in range(1, NI):
                yield from self._take_turn(W, blk, k, j)
                yield from self._wait_stage(W, n)
                yield from self._wait_stage(W, n + 1)
                yield ("step",)
                self._release(W, n)
                for c in range(1, NC):
                    yield from self._wait_stage(W, n + 1 + c)
                    yield ("step",)
                    self._release(W, n + c)
                held = n + NC
                n += 1 + NC
                self._pass_turn(W)
                yield ("step",)
                self._release(W, held)
                blk += 1
            yield from self._take_turn(W, blk, k, NI)
            yield from self._wait_stage(W, n)
            self._pass_turn(W)
            yield ("step",)
            self._release(W, n)
            n += 1
            blk += 1

    def skip_half(self, W, k, n, blk):
        NI, NC = self.NI, self.NC
        mut = self.mutation
        if mut != "no_x_wait":
            yield from self._wait_x(W, k)
        self._give_x(W)
        for b in range(NI + 1):
            yield from self._take_turn(W, blk, k, b)
            taken = NC if b == 0 else (1 if b == NI else NC + 1)
            if mut == "short_last" and b == NI:
                taken = 0
            for c in range(taken):
                if mut != "no_ready_wait":
                    yield from self._wait_stage(W, n + c)
                else:
                    self.stage_log[W].append(n + c)
                yield ("step",)
                self._release(W, n + c)
            n += taken
            self._pass_turn(W)
            blk += 1
            yield ("step",)

    # W1's skip path as several warps: all wait, warp 0 alone arrives (thread 0).
    def skip_warp(self, k_list, warp):
        """Warp `warp` of warpgroup 1 over its skipped tiles only (all tiles skipped)."""
        NI, NC = self.NI, self.NC
        n = blk = 0
        for k in range(len(self.tiles)):
            yield ("wait", self.x_ready[1], k & 1)
            if warp == 0:
                self._give_x(1)
            for b in range(NI + 1):
                yield ("wait", self.turn[1], (blk & 1))
                taken = NC if b == 0 else (1 if b == NI else NC + 1)
                for c in range(taken):
                    s = (n + c) % self.NSTAGE
                    yield ("wait", self.ready[s], ((n + c) // self.NSTAGE) & 1)
                    if warp == 0:
                        self.empty[s].arrive(1)
                    yield ("step",)
                n += taken
                if warp == 0:
                    self.turn[0].arrive(1)
                blk += 1
                yield ("step",)


def run(NI, NSTAGE, tiles, skip, seed, mutation=None, NC=2, w1_warps=1, max_steps=10**7):
    rng = random.Random(seed)
    wd = World(NI, NC, NSTAGE, tiles, mutation, w1_warps, rng)
    agents = {"loader": wd.w_loader(), "xloader": wd.x_loader(), "W0": wd.mma(0, skip)}
    if w1_warps == 1:
        agents["W1"] = wd.mma(1, skip)
    else:
        assert skip and all(tiles)
        for i in range(w1_warps):
            agents[f"W1.{i}"] = wd.skip_warp(None, i)
    # Random speeds: some agents run far ahead of others.
    speed = {a: rng.choice([0.05, 0.3, 1.0, 1.0, 3.0, 10.0]) for a in agents}
    async_speed = rng.choice([0.05, 0.5, 1.0, 5.0])
    state = {a: ("step",) for a in agents}
    done = set()
    steps = 0
    while True:
        steps += 1
        if steps > max_steps:
            return "too many steps", None
        runnable = [a for a in agents if a not in done and
                    (state[a][0] == "step" or state[a][1].passes(state[a][2]))]
        weights = [speed[a] for a in runnable]
        if wd.asyncs:
            runnable.append(None)
            weights.append(async_speed * len(wd.asyncs) ** 0.5)
        if not runnable:
            if len(done) == len(agents):
                break
            stuck = {a: (state[a][1].name, state[a][2], state[a][1].P)
                     for a in agents if a not in done}
            return "deadlock", stuck
        pick = rng.choices(runnable, weights)[0]
        try:
            if pick is None:
                i = rng.randrange(len(wd.asyncs))
                wd.asyncs.pop(i)()
                continue
            try:
                state[pick] = next(agents[pick])
            except StopIteration:
                done.add(pick)
        except Violation as e:
            return "violation", str(e)
    # After the run: every warpgroup read every stage once, in order.
    total = len(tiles) * wd.stages_per_tile()
    if w1_warps == 1:
        for W in (0, 1):
            if wd.stage_log[W] != list(range(total)):
                return "violation", f"warpgroup {W} read stages {wd.stage_log[W][:20]}..."
        want = [(W, k, b) for k in range(len(tiles)) for b in range(NI + 1) for W in (0, 1)]
        if wd.turn_log != want:
            return "violation", "turn order"
    for bar in wd.ready + wd.empty + wd.x_ready + wd.x_empty + wd.turn:
        if bar.pending != bar.count or bar.tx:
            return "violation", f"{bar.name} left with {bar.pending} pending arrivals"
    return "ok", steps


def random_tiles(rng, n):
    kind = rng.choice(["mixed", "all", "none", "alternate", "one"])
    if kind == "all":
        return [True] * n
    if kind == "none":
        return [False] * n
    if kind == "alternate":
        return [bool(i % 2) for i in range(n)]
    if kind == "one":
        t = [False] * n
        t[rng.randrange(n)] = True
        return t
    return [rng.random() < 0.5 for _ in range(n)]


def campaign(runs, skip, mutation=None, seed0=0, NIs=(1, 2, 20)):
    rng = random.Random(seed0)
    tally = {}
    example = {}
    for _i in range(runs):
        NI = rng.choice(NIs)
        NSTAGE = rng.randint(3, 7)
        ntiles = rng.randint(1, 6 if NI == 20 else 12)
        tiles = random_tiles(rng, ntiles)
        res, info = run(NI, NSTAGE, tiles, skip, seed=rng.randrange(1 << 30),
                        mutation=mutation)
        key = res
        tally[key] = tally.get(key, 0) + 1
        if res != "ok" and key not in example:
            example[key] = (NI, NSTAGE, tiles, info)
    return tally, example


if __name__ == "__main__":
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    for label, skip, mut in [("control: no skip", False, None),
                             ("skip (as committed)", True, None),
                             ("mutant: skip releases without waiting ready", True,
                              "no_ready_wait"),
                             ("mutant: skip gives x back without waiting x_ready", True,
                              "no_x_wait"),
                             ("mutant: skip takes no stage in its last block", True,
                              "short_last")]:
        tally, example = campaign(runs, skip, mut)
        print(f"{label}: {tally}")
        for k, v in example.items():
            print(f"   first {k}: NI={v[0]} NSTAGE={v[1]} tiles={v[2]}: {v[3]}")
        sys.stdout.flush()
