/**
 * Tells an unreachable or failing Postgres/Redis apart from a bug in our own statements.
 * Repositories wrap every call with these, so the rest of the code sees either a result,
 * a DomainError DEPENDENCY_UNAVAILABLE (503), or a genuine bug (500).
 */

// Postgres SQLSTATEs that mean "the server is not there for you right now":
// class 08 connection exception, 57P01-57P03 shutdown / cannot connect now, 53300 too many connections,
// 57014 statement timeout (we bounded it and it did not finish), 55P03 lock not available,
// 25P03 / 57P05 the server ended an idle (in-transaction) session: this process stalled mid-transaction,
// 40P01 / 40001 deadlock or serialization failure: the transaction was rolled back, a retry may pass.
const PG_OUTAGE_STATE = /^(08[0-9A-Z]{3}|57P0[1-5]|53300|57014|55P03|25P03|40P01|40001)$/;
const SQLSTATE = /^[0-9A-Z]{5}$/;

/** The SQLSTATE Postgres answered with (a TypeORM error carries its driver's), or undefined when it did not answer. */
export function sqlStateOf(err: unknown): string | undefined {
  const e = err as { code?: unknown; driverError?: { code?: unknown } } | null;
  const code = e?.driverError?.code ?? e?.code;
  return typeof code === 'string' && SQLSTATE.test(code) ? code : undefined;
}

/** A Postgres error is an outage unless the server answered with a SQLSTATE that blames the statement. */
export function isPostgresOutage(err: unknown): boolean {
  const code = sqlStateOf(err);
  return code === undefined || PG_OUTAGE_STATE.test(code);
}

// Redis replies that mean "not now" rather than "wrong command".
const REDIS_TRANSIENT_REPLY = /^(LOADING|BUSY|READONLY|MASTERDOWN|TRYAGAIN|CLUSTERDOWN|MOVED|ASK|OOM)\b/;

/** A Redis error is an outage unless Redis itself replied with an error about the command or script. */
export function isRedisOutage(err: unknown): boolean {
  const e = err as { name?: unknown; message?: unknown } | null;
  if (e?.name === 'ReplyError') return REDIS_TRANSIENT_REPLY.test(String(e.message ?? ''));
  return true;
}

/** A dependency the service cannot start without could not be reached; the message says which, and where. */
export class StartupError extends Error {}

/** Where a dependency is, for messages: host and port only, never the credentials. */
export function endpoint(url: URL, defaultPort: number): { host: string; port: string } {
  return { host: url.hostname, port: url.port || String(defaultPort) };
}

/**
 * The StartupError for `dependency` at `url`. When the server answered (a Postgres SQLSTATE, a Redis error reply:
 * a wrong password, a role that may not log in), it "refused the connection"; otherwise it "cannot be reached".
 */
export function unreachable(dependency: string, url: URL, defaultPort: number, cause: unknown, why = ''): StartupError {
  const { host, port } = endpoint(url, defaultPort);
  const answered = sqlStateOf(cause) !== undefined || (cause as { name?: unknown } | null)?.name === 'ReplyError';
  const what = answered ? 'refused the connection' : 'cannot be reached';
  return new StartupError(`${dependency} at ${host}:${port} ${what}${why ? ` ${why}` : ''}: ${reasonOf(cause)}`);
}

/** The StartupError for a dependency that refused what start-up asked of it (`action`: "to create database x"). */
export function refused(dependency: string, url: URL, defaultPort: number, action: string, cause: unknown, hint = ''): StartupError {
  const { host, port } = endpoint(url, defaultPort);
  return new StartupError(`${dependency} at ${host}:${port} refused ${action}: ${reasonOf(cause)}${hint ? ` (${hint})` : ''}`);
}

/**
 * What went wrong, in words. A host that resolves to several addresses (`localhost`: 127.0.0.1 and ::1) fails
 * with an AggregateError whose own message is empty: its errors say it. An Error without a message gives its code.
 */
function reasonOf(cause: unknown): string {
  if (cause instanceof AggregateError && !cause.message) return cause.errors.map(reasonOf).join('; ');
  if (cause instanceof Error) return cause.message || String((cause as { code?: unknown }).code ?? cause.name);
  return String(cause);
}
