"""One leaderboard: every method and defence trained on the same data and
protocol, every captured round attacked by the same attacks, and a report
(`grid` declares it, `board` runs it, `report` writes it)."""

from tff_privacy.leaderboard import board, defaults, grid, report
from tff_privacy.leaderboard.grid import Grid, Row
