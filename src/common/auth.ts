import { applyDecorators } from '@nestjs/common';
import { RouteConfig } from '@nestjs/platform-fastify';
import { ApiBearerAuth, ApiExtraModels, ApiResponse, ApiSecurity, getSchemaPath } from '@nestjs/swagger';
import { createHash } from 'node:crypto';
import type { IncomingHttpHeaders } from 'node:http';
import { ErrorResponseDto } from './api-errors.decorator.js';
import { DomainError, ErrorCode } from './errors.js';

/** The roles of API.md: each section of the API names the roles that may call it. */
export const ROLES = ['admin', 'client', 'reviewer'] as const;
export type Role = (typeof ROLES)[number];

/** The OpenAPI security scheme of the X-API-Key header (the other is the standard bearer scheme). */
export const API_KEY_SCHEME = 'apiKey';
export const API_KEY_HEADER = 'x-api-key';
/** An API key: 16-256 characters that need no quoting in an env var list (no ",", ":" or space). */
const API_KEY = /^[A-Za-z0-9._~+/=-]{16,256}$/;

/** What @Roles puts in a route's Fastify config, for the onRequest hook (app.factory.ts) to check. */
export interface RouteRoles {
  roles?: readonly Role[];
}

/**
 * The roles that may call a route (API.md). With API_KEYS set, the request must carry a key of one of them: checked
 * in the first request hook (keyRefusal), before the body is read or parsed. A route without roles (health,
 * metrics, docs) is open to all.
 */
export function Roles(...roles: Role[]): MethodDecorator {
  const error = { $ref: getSchemaPath(ErrorResponseDto) };
  const config: RouteRoles = { roles };
  return applyDecorators(
    RouteConfig(config),
    ApiBearerAuth(),
    ApiSecurity(API_KEY_SCHEME),
    ApiExtraModels(ErrorResponseDto),
    ApiResponse({ status: 401, description: 'UNAUTHENTICATED (only when API_KEYS is set): no valid key was sent', schema: error }),
    ApiResponse({
      status: 403,
      description: `FORBIDDEN (only when API_KEYS is set): the key's role is not ${roles.join(' or ')}`,
      schema: error,
    }),
  );
}

/** sha256 of a key, hex: keys are looked up by it, so that no comparison runs on the key itself. */
const digest = (key: string): string => createHash('sha256').update(key).digest('hex');

/**
 * Parses API_KEYS: comma-separated `role:key` entries, e.g. `admin:Kq3…,client:7fG…`. Returns the roles by the
 * key's digest, or the problems (which never quote a key).
 */
export function parseApiKeys(spec: string): { keys: Map<string, Role>; problems: string[] } {
  const keys = new Map<string, Role>();
  const problems: string[] = [];
  const entries = spec.split(',').map((entry) => entry.trim());
  entries.forEach((entry, i) => {
    const colon = entry.indexOf(':');
    const role = entry.slice(0, Math.max(colon, 0));
    const key = entry.slice(colon + 1);
    if (colon < 0 || !(ROLES as readonly string[]).includes(role)) {
      problems.push(`entry ${i + 1} must start with a role (${ROLES.join(', ')}) and ":"`);
    } else if (!API_KEY.test(key)) {
      problems.push(`entry ${i + 1}: a key must be 16-256 letters, digits or . _ ~ + / = -`);
    } else {
      const known = keys.get(digest(key));
      if (known !== undefined && known !== role) problems.push(`entry ${i + 1}: its key is given another role already (${known})`);
      else keys.set(digest(key), role as Role);
    }
  });
  return { keys, problems };
}

/** The key a request carries: `Authorization: Bearer <key>` or `X-API-Key: <key>`. */
function presentedKey(headers: IncomingHttpHeaders): string | undefined {
  const authorization = headers.authorization;
  if (typeof authorization === 'string') {
    const bearer = /^Bearer +(\S+) *$/i.exec(authorization);
    if (bearer) return bearer[1];
  }
  const header = headers[API_KEY_HEADER];
  return typeof header === 'string' && header !== '' ? header : undefined;
}

/**
 * Why a request may not call its route, if it may not: 401 UNAUTHENTICATED without a valid key, 403 FORBIDDEN with
 * a key of another role. `route`: the matched route's config (none for a path no route matches: its 404 is open).
 */
export function keyRefusal(keys: Map<string, Role>, route: RouteRoles | undefined, headers: IncomingHttpHeaders): DomainError | undefined {
  const allowed = route?.roles;
  if (allowed === undefined) return undefined;
  const key = presentedKey(headers);
  const role = key === undefined ? undefined : keys.get(digest(key));
  if (role === undefined) {
    return new DomainError(
      ErrorCode.UNAUTHENTICATED,
      key === undefined
        ? 'this call needs an API key: send it as "Authorization: Bearer <key>" or in the X-API-Key header'
        : 'the API key sent is not valid',
      { roles: allowed },
    );
  }
  if (!allowed.includes(role)) {
    return new DomainError(ErrorCode.FORBIDDEN, `a key of role "${role}" may not make this call; it needs ${allowed.join(' or ')}`, {
      role,
      roles: allowed,
    });
  }
  return undefined;
}
