import { realpathSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import pg from 'pg';
import { DataSource, DataSourceOptions, Logger } from 'typeorm';
import { AppConfig, loadConfig } from '../config/app-config.js';
import { dataSourceOptions } from './data-source.js';
import { isPostgresOutage, refused, sqlStateOf, unreachable } from '../common/dependency-errors.js';

const MIGRATION_LOCK = 7_361_905_021; // arbitrary, constant pg_advisory_lock key for respool migrations

function quoteIdent(name: string): string {
  return `"${name.replace(/"/g, '""')}"`;
}

/**
 * Creates the database named in DATABASE_URL when it does not exist yet. Connects to it first: a role
 * that may not connect to the `postgres` database (a locked-down production role) runs the service as
 * long as its own database exists; only a missing one is created from `postgres`. A Postgres that cannot
 * be reached is a StartupError that names it.
 */
export async function ensureDatabase(databaseUrl: string, timeoutMs = 5000): Promise<void> {
  const url = new URL(databaseUrl);
  const name = decodeURIComponent(url.pathname.replace(/^\//, '')) || 'postgres';
  const target = new pg.Client({ connectionString: databaseUrl, connectionTimeoutMillis: timeoutMs });
  try {
    await target.connect();
    await target.end();
    return;
  } catch (err) {
    await target.end().catch(() => undefined);
    if ((err as { code?: string }).code !== '3D000') throw unreachable('Postgres', url, 5432, err);
  }
  const admin = new URL(databaseUrl);
  admin.pathname = '/postgres';
  const client = new pg.Client({ connectionString: admin.toString(), connectionTimeoutMillis: timeoutMs });
  try {
    await client.connect();
  } catch (err) {
    await client.end().catch(() => undefined);
    throw unreachable('Postgres', admin, 5432, err, `to create database "${name}"`);
  }
  try {
    const found = await client.query('SELECT 1 FROM pg_database WHERE datname = $1', [name]);
    if (found.rowCount === 0) {
      try {
        await client.query(`CREATE DATABASE ${quoteIdent(name)}`);
      } catch (err) {
        // Another instance created it between our check and our CREATE: that is fine.
        const code = (err as { code?: string }).code;
        if (code === '42P04' || code === '23505') return;
        throw isPostgresOutage(err)
          ? unreachable('Postgres', admin, 5432, err, `to create database "${name}"`)
          : refused('Postgres', admin, 5432, `to create database "${name}"`, err, 'create it, or let the user create databases');
      }
    }
  } finally {
    await client.end();
  }
}

/**
 * Applies pending migrations under a Postgres advisory lock, so instances that start together
 * run them once. Returns the names of the migrations applied. What Postgres says while they run (a migration's
 * RAISE WARNING about rows it had to leave as they were) goes to `notice`.
 */
export async function runMigrations(config: AppConfig, notice: (message: string) => void = () => undefined): Promise<string[]> {
  await ensureDatabase(config.DATABASE_URL, config.DB_TIMEOUT_MS);
  try {
    return await migrate(config, notice);
  } catch (err) {
    // A statement Postgres refused (a user that may not create tables, say) or an outage midway: one line
    // that says where, not a driver's stack. Anything else (a bug in a migration) keeps its stack.
    const url = new URL(config.DATABASE_URL);
    const e = err as { code?: unknown; message?: unknown } | null;
    const answered = sqlStateOf(err) !== undefined;
    // A socket's error (ECONNRESET...) or the driver's word for a connection that went away.
    const lost = (typeof e?.code === 'string' && e.code.startsWith('E')) || /connect|terminated|timeout/i.test(String(e?.message ?? ''));
    if (answered || lost) {
      throw isPostgresOutage(err)
        ? unreachable('Postgres', url, 5432, err, 'to migrate')
        : refused('Postgres', url, 5432, 'a migration', err);
    }
    throw err;
  }
}

/** TypeORM's logger of a migration run: only what Postgres says (notices, which logNotifications passes to `log`). */
function noticesTo(notice: (message: string) => void): Logger {
  const ignore = () => undefined;
  return {
    log: (_level, message) => notice(String(message)),
    logQuery: ignore,
    logQueryError: ignore,
    logQuerySlow: ignore,
    logSchemaBuild: ignore,
    logMigration: ignore,
  };
}

async function migrate(config: AppConfig, notice: (message: string) => void): Promise<string[]> {
  const lock = new pg.Client({ connectionString: config.DATABASE_URL, connectionTimeoutMillis: config.DB_TIMEOUT_MS });
  await lock.connect();
  try {
    await lock.query('SELECT pg_advisory_lock($1)', [MIGRATION_LOCK]);
    // No statement timeouts while migrating: building an index or checking a constraint on a large table
    // takes longer than a request may.
    const options = dataSourceOptions(config);
    const extra = { ...('extra' in options ? options.extra : {}), statement_timeout: 0, query_timeout: undefined };
    const ds = new DataSource({ ...options, extra, logNotifications: true, logger: noticesTo(notice) } as DataSourceOptions);
    await ds.initialize();
    try {
      const applied = await ds.runMigrations({ transaction: 'each' });
      return applied.map((m) => m.name);
    } finally {
      await ds.destroy();
    }
  } finally {
    await lock.end();
  }
}

// `npm run migration:run`: apply pending migrations and exit.
// (Run as a script, not imported: compared as real paths, so that a symlink or a space in the path does not
// make it a silent no-op.)
if (process.argv[1] !== undefined && fileURLToPath(import.meta.url) === realpathOrSelf(process.argv[1])) {
  // A bad setting is one line (its message lists every bad variable), as at the service's start, not a stack.
  Promise.resolve()
    .then(() => runMigrations(loadConfig(process.env), (message) => console.warn(`postgres: ${message}`)))
    .then((applied) => {
      console.log(applied.length ? `applied: ${applied.join(', ')}` : 'no pending migrations');
    })
    .catch((err: unknown) => {
      console.error(err instanceof Error ? err.message : err);
      process.exitCode = 1;
    });
}

function realpathOrSelf(path: string): string {
  try {
    return realpathSync(path);
  } catch {
    return path;
  }
}
