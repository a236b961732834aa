# The two hosts of the example pair: each imports dspark-cluster.nix (the same cluster file on
# both) and differs only in its name, which is also its dspark node.
{
  hosts = {
    # The head (rank 0): serves the API once the worker is in the rendezvous.
    spark-a = {
      networking.hostName = "spark-a";
      services.dspark.node = "spark-a";
    };
    # The worker (rank 1).
    spark-b = {
      networking.hostName = "spark-b";
      services.dspark.node = "spark-b";
    };
  };
}
