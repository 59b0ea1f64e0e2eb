"""sdtk's shared package. STARTED: when the entry script first imported it (for start-up timing)."""
import time as _time

STARTED = _time.time()
