import { applyDecorators, createParamDecorator, ExecutionContext } from '@nestjs/common';
import { RouteConfig } from '@nestjs/platform-fastify';
import { ApiBearerAuth, ApiExtraModels, ApiResponse, ApiSecurity, getSchemaPath } from '@nestjs/swagger';
import { createHash } from 'node:crypto';
import type { FastifyRequest } from 'fastify';
import type { IncomingHttpHeaders } from 'node:http';
import { ErrorResponseDto } from './api-errors.decorator.js';
import { DomainError, ErrorCode } from './errors.js';

declare module 'fastify' {
  interface FastifyRequest {
    /** The owner (or reviewer) the request's API key is bound to, if it is bound to one; set by the first request hook. */
    actingFor: string | null;
  }
}

/** The roles of API.md: each section of the API names the roles that may call it. */
export const ROLES = ['admin', 'client', 'reviewer'] as const;
export type Role = (typeof ROLES)[number];

/** The OpenAPI security scheme of the X-API-Key header (the other is the standard bearer scheme). */
export const API_KEY_SCHEME = 'apiKey';
export const API_KEY_HEADER = 'x-api-key';
/** An API key: 16-256 characters that need no quoting in an env var list (no ",", ":" or space). */
const API_KEY = /^[A-Za-z0-9._~+/=-]{16,256}$/;
/**
 * The owner a key may be bound to: an owner or reviewer as the API takes them (1-128 characters), with no "," and no
 * space at either end (a typo there would make every call of the key 403).
 */
const BOUND_OWNER = /^(?! )[^,]{1,128}(?<! )$/u;

/** Who a key is: its role, and the one owner (or reviewer) it acts for, if it is bound to one. */
export interface ApiCaller {
  role: Role;
  owner?: string;
}

/** What @Roles puts in a route's Fastify config, for the onRequest hook (app.factory.ts) to check. */
export interface RouteRoles {
  roles?: readonly Role[];
}

/**
 * The roles that may call a route (API.md). With API_KEYS set, the request must carry a key of one of them: checked
 * in the first request hook (authorize), before the body is read or parsed. A route without roles (health,
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
    ApiResponse({
      status: 401,
      description: 'UNAUTHENTICATED (only when API_KEYS is set): no valid key was sent',
      schema: error,
      headers: { 'WWW-Authenticate': { description: 'The scheme a key is sent with: Bearer realm="respool"', schema: { type: 'string' } } },
    }),
    ApiResponse({
      status: 403,
      description:
        `FORBIDDEN (only when API_KEYS is set): the key's role is not ${roles.join(' or ')}` +
        (roles.some((role) => role !== 'admin') ? ", or the key is bound to another owner than the call's (details.actingFor)" : ''),
      schema: error,
    }),
  );
}

/** sha256 of a key, hex: keys are looked up by it, so that no comparison runs on the key itself. */
const digest = (key: string): string => createHash('sha256').update(key).digest('hex');

/**
 * Parses API_KEYS: comma-separated `role:key` or `role:key:owner` entries, e.g. `admin:Kq3…,client:7fG…:user-123`.
 * Returns the callers by the key's digest, or the problems (which never quote a key).
 */
export function parseApiKeys(spec: string): { keys: Map<string, ApiCaller>; problems: string[] } {
  const keys = new Map<string, ApiCaller>();
  const problems: string[] = [];
  const entries = spec.split(',').map((entry) => entry.trim());
  entries.forEach((entry, i) => {
    const [role, key = '', ...rest] = entry.split(':');
    const owner = rest.length > 0 ? rest.join(':') : undefined;
    if (entry.indexOf(':') < 0 || !(ROLES as readonly string[]).includes(role)) {
      problems.push(`entry ${i + 1} must start with a role (${ROLES.join(', ')}) and ":"`);
    } else if (!API_KEY.test(key)) {
      problems.push(`entry ${i + 1}: a key must be 16-256 letters, digits or . _ ~ + / = -`);
    } else if (owner !== undefined && (role === 'admin' || !BOUND_OWNER.test(owner))) {
      problems.push(
        role === 'admin'
          ? `entry ${i + 1}: an admin key acts for every owner; it takes none`
          : `entry ${i + 1}: the owner a key acts for must be 1-128 characters, with no space at either end`,
      );
    } else {
      const known = keys.get(digest(key));
      if (known !== undefined && (known.role !== role || known.owner !== owner)) {
        problems.push(`entry ${i + 1}: its key is given another role or owner already (${known.role})`);
      } else keys.set(digest(key), { role: role as Role, owner });
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
 * Who calls, if the request may call its route; else why not: 401 UNAUTHENTICATED without a valid key, 403
 * FORBIDDEN with a key of another role. `route`: the matched route's config (none for a path no route matches: its
 * 404 is open, and so are routes without roles).
 */
export function authorize(
  keys: Map<string, ApiCaller>,
  route: RouteRoles | undefined,
  headers: IncomingHttpHeaders,
): DomainError | ApiCaller | undefined {
  const allowed = route?.roles;
  if (allowed === undefined) return undefined;
  const key = presentedKey(headers);
  const caller = key === undefined ? undefined : keys.get(digest(key));
  if (caller === undefined) {
    return new DomainError(
      ErrorCode.UNAUTHENTICATED,
      key === undefined
        ? 'this call needs an API key: send it as "Authorization: Bearer <key>" or in the X-API-Key header'
        : 'the API key sent is not valid',
      { roles: allowed },
    );
  }
  if (!allowed.includes(caller.role)) {
    return new DomainError(ErrorCode.FORBIDDEN, `a key of role "${caller.role}" may not make this call; it needs ${allowed.join(' or ')}`, {
      role: caller.role,
      roles: allowed,
    });
  }
  return caller;
}

/** The owner (or reviewer) the request's key is bound to (the first request hook sets it), if it is bound to one. */
export const ActingFor = createParamDecorator((_: unknown, context: ExecutionContext): string | undefined => {
  return context.switchToHttp().getRequest<FastifyRequest>().actingFor ?? undefined;
});

/** 403 FORBIDDEN (API.md: "the caller is not the reservation's owner") unless a bound key acts for `owner`. */
export function mustActFor(actingFor: string | undefined, owner: string): void {
  if (actingFor === undefined || actingFor === owner) return;
  throw new DomainError(ErrorCode.FORBIDDEN, 'this API key acts for another owner', { actingFor });
}
