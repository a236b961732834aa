{
  description = "dspark: DeepSeek V4 Flash on two NVIDIA GB10 nodes (TP=2) as systemd services";

  inputs.nixpkgs.url = "github:nixos/nixpkgs/nixos-25.11";

  outputs =
    { self, nixpkgs }:
    let
      inherit (nixpkgs) lib;
      eachSystem = f: lib.genAttrs [ "aarch64-linux" "x86_64-linux" ] (system: f system nixpkgs.legacyPackages.${system});
      # The runtime's wheels are resolved for the GB10 nodes only.
      runtimeSystems = [ "aarch64-linux" ];
    in
    {
      packages = eachSystem (
        system: pkgs:
        rec {
          dspark = pkgs.callPackage ./nix/package.nix { };
          default = dspark;
        }
        // lib.optionalAttrs (lib.elem system runtimeSystems) {
          runtime = pkgs.callPackage ./nix/runtime.nix { };
        }
      );

      apps = eachSystem (system: pkgs: pkgs.callPackage ./nix/apps.nix { inherit (self.packages.${system}) dspark; });

      checks = eachSystem (system: _: { inherit (self.packages.${system}) dspark; });

      nixosModules.default =
        { lib, pkgs, ... }:
        let
          packages = self.packages.${pkgs.stdenv.hostPlatform.system};
        in
        {
          imports = [ ./modules/dspark.nix ];
          services.dspark.package = lib.mkDefault packages.dspark;
          services.dspark.runtimePackage = lib.mkDefault (packages.runtime or null);
        };
    };
}
