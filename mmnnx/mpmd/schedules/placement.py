"""How a schedule places its stages on ranks: which ``virtual_stages`` it runs, in which order its
stages go over the ranks (``stage_rules``' ``order``), and what its builder is given. Code outside
``mpmd/schedules/`` asks a schedule's :class:`Placement` and never branches on its kind."""

from __future__ import annotations

from mmnnx.mpmd.schedules.ir import check_counts


class Placement:
    """One way of placing stages on ranks. ``runs`` says which ``virtual_stages`` it runs
    (``"2 or more"``) and ``needs`` the placement in words; :meth:`order` is ``None`` for any other
    number."""

    name = "placement"
    runs = "any"  # the virtual_stages it runs, in words
    needs = "any number of stages per task"
    ONE_PER_RANK: Placement
    INTERLEAVED: Placement
    V_SHAPED: Placement
    BUILDER_DECIDES: Placement

    def order(self, virtual_stages: int) -> str | None:
        """How ``virtual_stages`` stages per rank go over the ranks: ``"loop"`` (rank ``r``
        holds stages ``r, r + R, ...``) or ``"v"`` (down and back up); ``None`` when this
        placement cannot run that many."""
        return "loop"

    def check(self, schedule: str, num_stages: int, num_microbatches: int, v: int) -> None:
        """Raises a ValueError naming ``schedule`` when it cannot run ``num_stages`` stages
        (``num_microbatches`` microbatches), ``v`` per rank (``virtual_stages``), with a
        message of its own; the registry refuses any other ``v`` :meth:`order` does not run."""

    def sizes(self, num_stages: int, num_microbatches: int, v: int) -> tuple[int, ...]:
        """The positional arguments this placement's builders take (after :meth:`check`)."""
        return (num_stages, num_microbatches, v)

    def __repr__(self) -> str:
        return f"<Placement {self.name}>"


class OnePerRank(Placement):
    """Rank ``r`` runs stage ``r``: ``builder(num_stages, M)``; ``v`` must be 1."""

    name, runs, needs = "one stage per rank", "1", "one stage per task"

    def order(self, virtual_stages: int) -> str | None:
        return "loop" if virtual_stages == 1 else None

    def sizes(self, num_stages: int, num_microbatches: int, v: int) -> tuple[int, ...]:
        return (num_stages, num_microbatches)


class Interleaved(Placement):
    """Rank ``r`` runs stages ``r, r + R, ...``: ``builder(num_stages / v, M, v)``."""

    name, runs, needs = "several stages per rank, looped", "2 or more", "several stages per task"

    def order(self, virtual_stages: int) -> str | None:
        return "loop" if virtual_stages >= 2 else None

    def check(self, schedule: str, num_stages: int, num_microbatches: int, v: int) -> None:
        check_counts(num_stages, num_microbatches)
        if v == 1:
            raise ValueError(
                f"{schedule} with virtual_stages=1 would run one stage per rank, the plain "
                "schedule it interleaves: pass virtual_stages >= 2 (and give each task that "
                "many stages, e.g. mm.stage_rules(..., virtual_stages=2)), or name a "
                "one-stage-per-rank schedule"
            )
        if num_stages % v:
            raise ValueError(
                f"virtual_stages={v} does not divide num_stages={num_stages}: "
                f"{schedule} puts virtual_stages stages on each of num_stages / virtual_stages "
                "ranks"
            )

    def sizes(self, num_stages: int, num_microbatches: int, v: int) -> tuple[int, ...]:
        return (num_stages // v, num_microbatches, v)


class VShaped(Placement):
    """Rank ``r`` runs stages ``r`` and ``2R - 1 - r``: ``builder(num_stages / 2, M)``."""

    name, runs, needs = "two stages per rank in a V", "2", "two stages per task, in a V"

    def order(self, virtual_stages: int) -> str | None:
        return "v" if virtual_stages == 2 else None

    def check(self, schedule: str, num_stages: int, num_microbatches: int, v: int) -> None:
        check_counts(num_stages, num_microbatches)
        if v != 2 or num_stages % 2:
            raise ValueError(
                f"{schedule} places two stages per rank in a V: it needs virtual_stages=2 and "
                f"an even number of stages, got virtual_stages={v} and "
                f"{num_stages} stages"
            )

    def sizes(self, num_stages: int, num_microbatches: int, v: int) -> tuple[int, ...]:
        return (num_stages // 2, num_microbatches)


class BuilderDecides(Placement):
    """A :func:`~mmnnx.mpmd.schedules.register`-ed builder: ``builder(num_stages, M, v)``."""

    name, needs = "as the builder decides", "as registered"


Placement.ONE_PER_RANK = OnePerRank()
Placement.INTERLEAVED = Interleaved()
Placement.V_SHAPED = VShaped()
Placement.BUILDER_DECIDES = BuilderDecides()
