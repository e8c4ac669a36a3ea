"""Run a notebook over a grid of parameters with papermill and collect what it glues into one table.

Command line, from anywhere (the kernels run in the repository root, as the book's do)::

    python -m kvlab.sweep NOTEBOOK -p NAME V1,V2,... [-p NAME V1,...] [--out DIR] [--workers N]
                          [--executor local|dask] [--address ADDR] [--force] [--execution-timeout S]

Grid. Each ``-p NAME VALUES`` is one axis; the runs are the cartesian product of the axes in the
order given (the last axis varies fastest). ``NAME`` must be assigned in the notebook's cell tagged
``parameters``. ``VALUES`` is split at the commas that are outside quotes and brackets, and each
value is read as

* ``True``, ``False`` (any case): a bool; ``None`` (any case): None;
* an integer (``64``, ``-1``): an int; a decimal or special float (``0.5``, ``1e-3``, ``inf``, ``nan``): a float;
* a quoted string (``'3'``) or a Python list, tuple or dict literal (``[64, 128]``): that literal;
* anything else (``haar``): a string.

Where the parameters cell gives a string default, a value read as a number stays its text
(``-p label 3`` passes ``"3"``). Where it gives a number, a bool, a list or a dict, a value of
another kind is an error (None is always accepted: notebooks use it for "automatic").
An unknown name, an axis without values, an empty or unbalanced value, a repeated name or value, a
grid of more than ``MAX_RUNS`` runs, a notebook that is not valid nbformat 4: all are errors reported
before anything runs (exit code 2). So are outputs the sweep could not write at its end: a folder
where it writes a file (``results.csv``, ``results.png``, a run's notebook), a folder it cannot write
into, a ``results.csv`` it cannot read.

Output. ``DIR`` (default ``sweeps``) receives, for a notebook ``name.ipynb``:

* ``DIR/name/<key>.ipynb``: one executed notebook per run, ``<key>`` the parameters spelled out
  (``bits=2__dim=64__rotation=haar``) or, for values that are not plain file-name text,
  ``run-<hash of the parameters>``; its metadata ``kvlab_sweep`` records the parameters, the
  source notebook's SHA-256, the status and the duration;
* ``DIR/name/results.csv``: one row per run of this grid, in grid order: the parameters, every
  scalar (int, float, bool, str, None) the notebook glues with ``myst_nb.glue``, then ``status``
  (``ok``/``failed``), ``duration_s``, ``error`` and ``notebook``. A glued name that is also a swept
  parameter is stored as ``glued.<name>``;
* ``DIR/name/results.png``: the default plot (see ``plot_results``).

Resuming. A run whose executed notebook exists, succeeded, and was made from the same source
notebook bytes with the same parameters is skipped (its row is read back from the notebook);
failed runs and runs of an edited notebook rerun. ``--force`` reruns everything (needed after a
change to kvlab itself, which the check does not see).

Failures. A failing run is reported with its parameters, the failing cell and the error; its
executed notebook is kept; the other runs go on. The exit code is 0 when every run succeeded and 1
otherwise (130 when interrupted, 143 when terminated with SIGTERM).

One table per folder. Sweeps of one notebook into one ``--out`` share ``results.csv``: a run's row
replaces the row of the same parameter values, rows of other grid points stay (a sweep over other
parameter names is refused, exit code 2, before anything runs). Writers take turns (a lock file,
``.results.lock``) and each writes through a temporary file of its own, renamed over the table;
``.results.json`` records which columns are the parameters. A glued ``nan`` or ``inf`` is written as
``nan`` / ``inf`` (an empty cell means "not glued").

Stopping. On Ctrl-C (SIGINT) or SIGTERM the sweep ends the runs in flight at once: papermill is
interrupted so that it shuts its kernel down, then it and its kernel are killed after ``STOP_GRACE_S``
seconds (another Ctrl-C meanwhile does not cut that short);
their temporary folders are removed, finished runs' notebooks are kept (each written atomically) and
``results.csv`` is left as it was. A sweep killed with SIGKILL cannot do this: its papermill
processes (each in a session of its own) run on to their end and leave their ``kvlab-sweep-*``
temporary folders.

Executors. Each run is one ``python -m papermill`` process whose kernel runs in the repository
root with the root on ``PYTHONPATH``.

* ``local`` (default): one worker per visible GPU, each run pinned to its worker's GPU with
  ``CUDA_VISIBLE_DEVICES`` (``--workers N`` uses the first N GPUs). Without a GPU, ``--workers``
  processes (default 1) with ``TRITON_INTERPRET=1``, each with ``OMP_NUM_THREADS`` set to its
  share of the CPU cores unless already set.
* ``dask``: every run is a task submitted to the ``dask.distributed`` scheduler at ``--address``,
  asking for one ``GPU`` worker resource, so a worker declared with ``--resources GPU=1`` runs one
  at a time. Start one worker per GPU, each with its own ``CUDA_VISIBLE_DEVICES``. The source
  notebook travels with the task and the executed notebook comes back to the client, so workers need
  the same kvlab checkout (importable: started from its root with ``PYTHONPATH=.``) and Python
  environment, but no shared file system. A worker without a GPU
  runs the notebook under ``TRITON_INTERPRET=1``.
"""

from .api import EXECUTORS, METADATA_KEY, STATUS_COLUMNS, SweepResult, plot_results, sweep
from .cli import main
from .grid import MAX_RUNS, Run, SweepError, format_value, notebook_parameters, parse_axis, run_key
from .run import (
    KERNEL_START_ATTEMPTS, KERNEL_START_FAILURE, STOP_GRACE_S, Outcome, Task, decode_glued, diagnose_notebook, execute,
    glued_scalars,
)

__all__ = [
    "EXECUTORS",
    "KERNEL_START_ATTEMPTS",
    "KERNEL_START_FAILURE",
    "MAX_RUNS",
    "METADATA_KEY",
    "STATUS_COLUMNS",
    "STOP_GRACE_S",
    "Outcome",
    "Run",
    "SweepError",
    "SweepResult",
    "Task",
    "decode_glued",
    "diagnose_notebook",
    "execute",
    "format_value",
    "glued_scalars",
    "main",
    "notebook_parameters",
    "parse_axis",
    "plot_results",
    "run_key",
    "sweep",
]
