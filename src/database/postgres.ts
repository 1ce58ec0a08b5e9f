import { isPostgresOutage } from '../common/dependency-errors.js';
import { DomainError } from '../common/errors.js';

/** Runs a Postgres call; a lost or unreachable server becomes 503 DEPENDENCY_UNAVAILABLE. */
export async function pg<T>(fn: () => Promise<T>): Promise<T> {
  try {
    return await fn();
  } catch (err) {
    if (err instanceof DomainError) throw err;
    throw isPostgresOutage(err) ? DomainError.unavailable('postgres', err) : err;
  }
}
