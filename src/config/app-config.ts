import { isIP } from 'node:net';
import 'reflect-metadata';
import { plainToInstance, Transform } from 'class-transformer';
import { parseApiKeys } from '../common/auth.js';
import { IsIn, IsInt, IsOptional, IsString, Matches, Max, Min, ValidateBy, validateSync } from 'class-validator';

/** A URL that `new URL` takes (a port above 65535, a bad host or a stray character it refuses). */
function IsParsableUrl(): PropertyDecorator {
  return ValidateBy({
    name: 'isParsableUrl',
    validator: {
      validate: (value: unknown) => typeof value === 'string' && URL.canParse(value),
      defaultMessage: (args) => `${args?.property ?? 'the value'} is not a URL that can be parsed`,
    },
  });
}

/** API_KEYS as parseApiKeys takes it; the message names the bad entries, never a key. */
function IsApiKeyList(): PropertyDecorator {
  return ValidateBy({
    name: 'isApiKeyList',
    validator: {
      validate: (value: unknown) => value === '' || (typeof value === 'string' && parseApiKeys(value).problems.length === 0),
      defaultMessage: (args) =>
        typeof args?.value === 'string' ? parseApiKeys(args.value).problems.join('; ') : 'API_KEYS must be a string',
    },
  });
}

/** A setting as a problem report may show it: a URL's password or an API key replaced, so it never reaches a log. */
export function redacted(key: string, value: string | undefined): string {
  if (value !== undefined && key === 'API_KEYS') return '"***"';
  if (value === undefined || !key.endsWith('_URL')) return JSON.stringify(value);
  // Parsable or not: after the scheme, what lies between the first ":" and the last "@" is the password.
  const scheme = /^[a-z][a-z0-9+.-]*:\/*/i.exec(value)?.[0] ?? '';
  const rest = value.slice(scheme.length);
  const at = rest.lastIndexOf('@');
  const colon = rest.indexOf(':');
  if (at < 0 || colon < 0 || colon > at) return JSON.stringify(value);
  return JSON.stringify(`${scheme}${rest.slice(0, colon + 1)}***${rest.slice(at)}`);
}

const toInt = ({ value }: { value: unknown }) => (typeof value === 'string' && /^-?\d+$/.test(value.trim()) ? Number(value) : value);

/**
 * Every setting the service reads, validated once at boot. The env var name is the
 * property name; defaults are the values a developer on a fresh machine wants.
 * Nothing else in the code base reads process.env.
 */
export class AppConfig {
  @IsString()
  @Matches(/^postgres(ql)?:\/\/.+/, { message: 'DATABASE_URL must be a postgres:// URL' })
  @IsParsableUrl()
  DATABASE_URL = 'postgres://postgres@127.0.0.1:5432/respool';

  @IsString()
  @Matches(/^rediss?:\/\/.+/, { message: 'REDIS_URL must be a redis:// URL' })
  @IsParsableUrl()
  REDIS_URL = 'redis://127.0.0.1:6379';

  @Transform(toInt)
  @IsInt()
  @Min(0)
  @Max(65535)
  PORT = 3000;

  @IsString()
  HOST = '0.0.0.0';

  /** Prefix of every Redis key this deployment writes; lets several deployments (or test files) share one Redis. */
  @IsString()
  @Matches(/^[A-Za-z0-9:_-]{0,64}$/, { message: 'REDIS_KEY_PREFIX may hold letters, digits, ":", "_" and "-" (64 at most)' })
  REDIS_KEY_PREFIX = 'respool:';

  @IsIn(['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent'])
  LOG_LEVEL = 'info';

  /** Log one line per HTTP request (request id, route, status, time). */
  @IsIn(['true', 'false'])
  LOG_REQUESTS = 'true';

  /**
   * Wake reserves that wait (waitMs) when items come free (WakeUps: a second Redis connection, subscribed while
   * reserves wait). `false`: waiters only try again on their own, the first in line every 50-75 ms.
   */
  @IsIn(['true', 'false'])
  WAIT_WAKE_UPS = 'true';

  @Transform(toInt)
  @IsInt()
  @Min(1)
  @Max(200)
  DB_POOL_SIZE = 10;

  /** Upper bound of every Postgres statement and of acquiring a connection, in ms. */
  @Transform(toInt)
  @IsInt()
  @Min(100)
  @Max(600_000)
  DB_TIMEOUT_MS = 5000;

  /** Upper bound of every Redis command, in ms. */
  @Transform(toInt)
  @IsInt()
  @Min(50)
  @Max(600_000)
  REDIS_TIMEOUT_MS = 2000;

  /**
   * How long a hold outlives its reservation's expiresAt before the sweeper may return its items: a
   * confirm that arrived just before expiresAt and reaches Redis a little after it (a busy instance, a
   * GC pause) still finds its hold. Items are free again within SWEEP_INTERVAL_MS and one sweep pass of the
   * grace's end; API.md promises 2 s in all, so the grace and the interval must leave room for the pass (see
   * expiryBudgetWarning).
   */
  @Transform(toInt)
  @IsInt()
  @Min(0)
  @Max(1000)
  HOLD_GRACE_MS = 500;

  /** How often each instance returns expired holds to the pool. */
  @Transform(toInt)
  @IsInt()
  @Min(20)
  @Max(10_000)
  SWEEP_INTERVAL_MS = 250;

  /** How often one instance re-adds free Postgres rows missing from Redis (0 = only at start-up, after a wipe, and to finish a rebuild that failed midway). */
  @Transform(toInt)
  @IsInt()
  @Min(0)
  @Max(86_400_000)
  RECONCILE_INTERVAL_MS = 60_000;

  /** How long confirm/complete pins a hold while it commits to Postgres. */
  @Transform(toInt)
  @IsInt()
  @Min(1000)
  @Max(600_000)
  COMMIT_WINDOW_MS = 15_000;

  /** How long a closed (confirmed, released, expired) reservation stays readable in Redis. */
  @Transform(toInt)
  @IsInt()
  @Min(1000)
  @Max(30 * 86_400_000)
  RESERVATION_RETENTION_MS = 86_400_000;

  /**
   * How long an Idempotency-Key is remembered. At most RESERVATION_RETENTION_MS: a retry must find the
   * reservation the key names, or it would make a second one.
   */
  @Transform(toInt)
  @IsInt()
  @Min(1000)
  @Max(30 * 86_400_000)
  IDEMPOTENCY_TTL_MS = 86_400_000;

  /** Largest request body, in bytes (413 PAYLOAD_TOO_LARGE above it). */
  @Transform(toInt)
  @IsInt()
  @Min(1024)
  @Max(104_857_600)
  BODY_LIMIT_BYTES = 8 * 1024 * 1024;

  /**
   * How long a request may take to arrive, headers and body (the headers alone: at most 60 s); one that takes longer is
   * answered 408 and its connection closed. It does not bound the answer: a reserve may wait its `waitMs` after it.
   */
  @Transform(toInt)
  @IsInt()
  @Min(1000)
  @Max(3_600_000)
  REQUEST_TIMEOUT_MS = 60_000;

  /** Requests per second allowed per client address on each instance (0 = no limit). */
  @Transform(toInt)
  @IsInt()
  @Min(0)
  @Max(10_000_000)
  RATE_LIMIT_PER_SECOND = 0;

  /** Most requests a client may send at once: its token bucket's size (0 = RATE_LIMIT_PER_SECOND); refilled at the rate. */
  @Transform(toInt)
  @IsInt()
  @Min(0)
  @Max(10_000_000)
  @IsOptional()
  RATE_LIMIT_BURST = 0;

  /**
   * The proxies in front of the instance whose X-Forwarded-For it believes about a client's address (the rate limit
   * counts by it, request lines show it): unset, none (the address is the connection's, so behind a load balancer
   * every client is the balancer); `true`, every hop (only where no client reaches the instance but through them); or
   * a comma-separated list of addresses and CIDR ranges (`loopback`, `linklocal` and `uniquelocal` name the usual ones). Checked by
   * trustProxyProblem.
   */
  @IsString()
  TRUST_PROXY = '';

  /** Reserves that may wait for free items (waitMs) at once on each instance; one more is answered 429. */
  @Transform(toInt)
  @IsInt()
  @Min(0)
  @Max(1_000_000)
  MAX_WAITING_RESERVES = 1_000;

  /**
   * API keys and their roles, `role:key` or `role:key:owner` separated by commas (roles: admin, client, reviewer; an
   * owner binds a client or reviewer key to it). Empty: every call is open. Set: every /v1 call needs a key of a role
   * API.md allows it (401 without, 403 with another role, or for another owner than the key's).
   */
  @IsApiKeyList()
  API_KEYS = '';

  /** How long graceful shutdown waits for in-flight requests (0 would exit 1 at once, answering nothing). */
  @Transform(toInt)
  @IsInt()
  @Min(1000)
  @Max(600_000)
  SHUTDOWN_TIMEOUT_MS = 10_000;
}

export class ConfigError extends Error {
  constructor(readonly problems: string[]) {
    super(`invalid configuration:\n  - ${problems.join('\n  - ')}`);
    this.name = 'ConfigError';
  }
}

/**
 * API.md: an expired reservation's items are free again within 2 s. The grace and the sweep interval are spent
 * inside those 2 s, before a sweep pass (tens of milliseconds, more with many pools under load): past 1.5 s
 * together they leave the pass too little. Accepted (a test may slow the sweeper on purpose), with a warning.
 */
export function expiryBudgetWarning(config: AppConfig): string | null {
  const spent = config.HOLD_GRACE_MS + config.SWEEP_INTERVAL_MS;
  if (spent <= 1500) return null;
  return (
    `HOLD_GRACE_MS (${config.HOLD_GRACE_MS}) + SWEEP_INTERVAL_MS (${config.SWEEP_INTERVAL_MS}) = ${spent} ms: expired items may ` +
    'take longer than the 2 s API.md promises to be free again; keep the two within 1,500 ms together'
  );
}

/** A setting's failed constraints; a value that is not an integer at all is told only that (not its bounds too). */
function messages(constraints: Record<string, string> = {}): string {
  return constraints.isInt ?? Object.values(constraints).join('; ');
}

/** Reads and validates the whole configuration; every bad variable is reported at once. */
export function loadConfig(env: Record<string, string | undefined>): AppConfig {
  const known = Object.keys(new AppConfig());
  const given: Record<string, string> = {};
  for (const key of known) {
    const value = env[key];
    if (value !== undefined && value !== '') given[key] = value;
  }
  const config = plainToInstance(AppConfig, given);
  const errors = validateSync(config, { whitelist: true, forbidUnknownValues: true });
  const problems = errors.map((e) => `${e.property}=${redacted(e.property, env[e.property])}: ${messages(e.constraints)}`);
  const bad = new Set(errors.map((e) => e.property));
  if (
    !bad.has('IDEMPOTENCY_TTL_MS') &&
    !bad.has('RESERVATION_RETENTION_MS') &&
    config.IDEMPOTENCY_TTL_MS > config.RESERVATION_RETENTION_MS
  ) {
    problems.push(
      `IDEMPOTENCY_TTL_MS=${JSON.stringify(String(config.IDEMPOTENCY_TTL_MS))}: must not exceed RESERVATION_RETENTION_MS (${config.RESERVATION_RETENTION_MS}): a retry after the reservation's record is gone would make a second reservation`,
    );
  }
  const trust = bad.has('TRUST_PROXY') ? null : trustProxyProblem(config.TRUST_PROXY);
  if (trust !== null) problems.push(`TRUST_PROXY=${JSON.stringify(config.TRUST_PROXY)}: ${trust}`);
  if (problems.length > 0) throw new ConfigError(problems);
  return config;
}

const PROXY_RANGE_NAMES = new Set(['loopback', 'linklocal', 'uniquelocal']);

/** What is wrong with a TRUST_PROXY value, or null: each list entry an address, a CIDR range or a range's name. */
export function trustProxyProblem(value: string): string | null {
  if (value === '' || value === 'true' || value === 'false') return null;
  for (const entry of value.split(',').map((part) => part.trim())) {
    if (PROXY_RANGE_NAMES.has(entry)) continue;
    const [address, bits, extra] = entry.split('/');
    const family = isIP(address ?? '');
    const maxBits = family === 4 ? 32 : 128;
    // (proxy-addr refuses a /0, and netmask notation is not taken.)
    const bitsOk = bits === undefined || (/^[0-9]{1,3}$/.test(bits) && Number(bits) >= 1 && Number(bits) <= maxBits);
    if (family === 0 || !bitsOk || extra !== undefined) {
      return `${JSON.stringify(entry)} is not an address, a CIDR range (/1 or more) or one of loopback, linklocal, uniquelocal; TRUST_PROXY is true or a comma-separated list of those`;
    }
  }
  return null;
}

/**
 * TRUST_PROXY as Fastify's trustProxy option takes it. (No number of hops: with one, a client that reaches the instance
 * directly names any address it likes.)
 */
export function trustProxyOption(value: string): boolean | string {
  if (value === '' || value === 'false') return false;
  return value === 'true' ? true : value;
}
