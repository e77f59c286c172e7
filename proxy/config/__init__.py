"""The configuration: one frozen ``Settings``, read once at start from a YAML file, the environment and the flags.

settings      the one frozen ``Settings`` type, its sections, its environment variables and its JSON Schema
switching     a route's switch to a candidate engine: the guarded rollout and the one-GPU swap
fields        the field types every section shares: names, keys, seconds, URLs, listen addresses
crosscheck    what one key's type cannot say: references between sections, a route's switch made coherent
configfile    the YAML config file -> ``Settings`` (strict, one line per problem), the environment, the flags
"""
