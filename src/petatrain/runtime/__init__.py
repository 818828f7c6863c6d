"""The only code that talks to Ray: cluster start/connect, the supervisor, the watchdog, the hub,
what a training rank gets from Ray, and `_ray/`, the one corner that touches Ray's private modules.

Modules here import Ray lazily (inside functions) where they can: `import ray` costs a second or
more, and a command that fails on its config should not pay it.
"""
