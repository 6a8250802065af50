"""Starting rank processes and supervising them: the layer between the collective core and
the launchers users call (``flyte-hvd-run``, ``flyte_hvd.spark.run``, ``HorovodRunner``).

``supervisor`` starts ranks (``mpiexec -n 1 python -m flyte_hvd.launch.bootstrap``), serves
their control sockets and turns failures into one error; ``bootstrap`` is the rank process;
``rendezvous`` joins separately started ranks into one communicator; ``spare`` keeps rank
processes with their framework imported for the next run; ``stall`` decides when a run is
stuck; ``output`` carries the ranks' bytes to the user; ``environment`` is what ranks take from
the driver; ``messages`` declares what the supervisor, ranks and driver say to each other;
``cli`` is ``flyte-hvd-run``. Nothing here imports a framework or Spark.
"""
