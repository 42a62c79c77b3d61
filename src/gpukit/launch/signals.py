"""How the launcher and the ranks read the user's stop signals.

Both the supervisor and each rank's preemption handler tell a user's second Ctrl-C from copies
of the first (a terminal sends SIGINT to the whole process group), so they share one threshold.

>>> SECOND_SIGNAL_AFTER_S > 0
True
"""

from __future__ import annotations

SECOND_SIGNAL_AFTER_S = 2.0  # a SIGINT this long after the first is the user's second Ctrl-C
