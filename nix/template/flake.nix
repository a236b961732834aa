{
  description = "Two GB10 hosts running dspark (DeepSeek V4 Flash, TP=2)";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-26.05";
  inputs.dspark.url = "path:/path/to/dspark"; # CHANGEME: where you keep the dspark repository
  inputs.dspark.inputs.nixpkgs.follows = "nixpkgs";

  outputs =
    { nixpkgs, dspark, ... }:
    {
      # `sudo nixos-rebuild switch --flake .#spark-b` on the worker, `.#spark-a` on the head.
      nixosConfigurations = nixpkgs.lib.mapAttrs (
        _: host:
        nixpkgs.lib.nixosSystem {
          system = "aarch64-linux";
          modules = [
            dspark.nixosModules.default
            ./dspark-cluster.nix
            ./example-hardware.nix # CHANGEME: the host's own hardware configuration
            host
          ];
        }
      ) (import ./hosts.nix).hosts;
    };
}
