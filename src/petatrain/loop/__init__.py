"""The embedded continuous-training loop's parts below `api`: its spec (`LOOP.yaml`), the watcher
of the source files, and the record of each dataset version it handled. The cycle itself (append,
continue, evaluate, promote) is `api.loop_cycle`; `petatrain loop` runs it on a schedule."""
