"""Airflow 3 DAGs that keep a model current (petatrain.airflow): `petatrain_ingest` every 5 minutes
appends the stable new files of the loop's source as a dataset version and announces it as an asset
event; `petatrain_train`, scheduled on that dataset's Asset, continues the champion onto it, then
evaluates and promotes. Put this file in Airflow's dags folder, with:

    PETATRAIN_LOOP=/path/to/loop.yaml      # the loop (examples/loop.yaml: its paths are the demo's)
    PETATRAIN_BIN=/path/to/.venv/bin/petatrain

and petatrain installed in Airflow's environment without its dependencies (pip install --no-deps
petatrain): Airflow and petatrain pin different fastapi versions (docs/continuous-training.md).
"""

import datetime
import os

from petatrain.airflow import continuous_dags

loop_file = os.environ.get("PETATRAIN_LOOP", os.path.join(os.path.dirname(__file__), "..", "loop.yaml"))
ingest_dag, train_dag = continuous_dags(loop_file, schedule=datetime.timedelta(minutes=5))
