"""The hyper-parameters of Directed Beam Search, validated once (paper values as defaults)."""
from dataclasses import dataclass, asdict

from .errors import DBSError

BOOST_ORDERS = ("filter_then_boost", "boost_then_filter")


@dataclass(frozen=True)
class DBSConfig:
    lam: float = 20.0            # guidance strength lambda; paper picks 20 (best success, Fig. 1)
    beams: int = 7               # b: beams kept after every chunk (paper's chosen setting)
    candidates: int = 10         # s: candidates per beam, all b*s decoded as one batch
    chunk: int = 5               # k: tokens per chunk; sets keyword density (paper: 5)
    top_p: float = 0.9           # nucleus sampling, as in the paper
    temperature: float = 1.0
    alpha: float = 0.001         # weight of perplexity in the quality score
    c_star: float = 2.0          # penalty when the guide word is absent (favours c = 1 over 0)
    max_new_tokens: int = 90     # paper: termination after 90 tokens
    boost_order: str = "filter_then_boost"  # the authors' code: top-p first, then boosts
    boost_cutoff: float = 0.01   # sparse table drops boosts below this (logit units = max error)
    guided: bool = True          # False = the unguided baseline (no boosts)

    def __post_init__(self):
        for name in ("beams", "candidates", "chunk", "max_new_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise DBSError(f"`{name}` must be an integer >= 1, got {v!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise DBSError(f"`top_p` must be a float in (0, 1], got {self.top_p!r}")
        if not (0.0 <= self.lam <= 80.0):
            raise DBSError(f"`lambda` must be in [0, 80] (exp(lambda) must fit float32), got {self.lam!r}")
        if not self.temperature > 0.0:
            raise DBSError(f"`temperature` must be > 0, got {self.temperature!r}")
        if self.alpha < 0 or self.c_star < 0:
            raise DBSError(f"`alpha` and `c_star` must be >= 0, got {self.alpha!r}, {self.c_star!r}")
        if self.boost_order not in BOOST_ORDERS:
            raise DBSError(f"`boost_order` must be one of {BOOST_ORDERS}, got {self.boost_order!r}")
        if self.boost_cutoff < 0:
            raise DBSError(f"`boost_cutoff` must be >= 0, got {self.boost_cutoff!r}")

    def to_dict(self) -> dict:
        return asdict(self)
