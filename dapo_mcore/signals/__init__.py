"""What a process does about signals that no step handles: Ctrl-C during a distributed start-up (``startup``) and
the SIGKILL fault points the resume tests use (``faults``). Imports nothing of the project's, so every floor may."""
