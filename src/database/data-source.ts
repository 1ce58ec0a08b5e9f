import { DataSourceOptions } from 'typeorm';
import { Init1763700000000 } from '../../migrations/1763700000000-Init.js';
import { CommitDecision1763800000000 } from '../../migrations/1763800000000-CommitDecision.js';
import { RedisGeneration1763900000000 } from '../../migrations/1763900000000-RedisGeneration.js';
import { FreeRowsById1764000000000 } from '../../migrations/1764000000000-FreeRowsById.js';
import { AllocateFunction1764100000000 } from '../../migrations/1764100000000-AllocateFunction.js';
import { AllocateAllAtOnce1764200000000 } from '../../migrations/1764200000000-AllocateAllAtOnce.js';
import { AttributesAreStrings1764300000000 } from '../../migrations/1764300000000-AttributesAreStrings.js';
import { KeyedCommits1764400000000 } from '../../migrations/1764400000000-KeyedCommits.js';
import { RedisCheckpoint1764500000000 } from '../../migrations/1764500000000-RedisCheckpoint.js';
import { AppConfig } from '../config/app-config.js';
import { ENTITIES } from './entities.js';

export const MIGRATIONS = [
  Init1763700000000,
  CommitDecision1763800000000,
  RedisGeneration1763900000000,
  FreeRowsById1764000000000,
  AllocateFunction1764100000000,
  AllocateAllAtOnce1764200000000,
  AttributesAreStrings1764300000000,
  KeyedCommits1764400000000,
  RedisCheckpoint1764500000000,
];

export function dataSourceOptions(config: AppConfig): DataSourceOptions {
  return {
    type: 'postgres',
    url: config.DATABASE_URL,
    entities: ENTITIES,
    migrations: MIGRATIONS,
    migrationsTableName: 'typeorm_migrations',
    synchronize: false,
    migrationsRun: false,
    logging: false,
    poolSize: config.DB_POOL_SIZE,
    connectTimeoutMS: config.DB_TIMEOUT_MS,
    extra: {
      // Bound every statement on the server and on the client: a request never hangs on Postgres.
      statement_timeout: config.DB_TIMEOUT_MS,
      // A process paused inside a transaction (GC, SIGSTOP) must not keep row locks: Postgres ends its session.
      idle_in_transaction_session_timeout: config.DB_TIMEOUT_MS,
      query_timeout: config.DB_TIMEOUT_MS + 1000,
      connectionTimeoutMillis: config.DB_TIMEOUT_MS,
      idleTimeoutMillis: 30_000,
      keepAlive: true,
      application_name: 'respool',
    },
  };
}
